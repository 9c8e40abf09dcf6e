"""``approx-prefix-cache-producer``: which endpoints probably hold the prompt's prefix in KV cache."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from epp.framework import (
    CycleState,
    DataProducer,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    RequestBody,
    SchedulingResult,
    register,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, Groups, PrefixMatches, group_count
from epp.framework.candidates import CandidateMemo
from epp.framework.cross_replica import SharedLog
from epp.framework.params import OMIT_UNSET
from epp.plugins.producers import _prefix_metrics
from epp.plugins.producers._prefix_index import PrefixIndex

__all__ = [
    "DEFAULT_BLOCK_SIZE_TOKENS",
    "DEFAULT_LRU_CAPACITY_PER_SERVER",
    "ApproxPrefixCacheParams",
    "ApproxPrefixCacheProducer",
    "block_hashes",
    "hash_seed",
    "prompt_start",
]

DEFAULT_BLOCK_SIZE_TOKENS = 16
DEFAULT_MAX_PREFIX_BLOCKS = 256
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250  # ~500K tokens of KV cache / 16-token blocks
CHARS_PER_TOKEN = 4
PREFILL_PROFILE = "prefill"
SWEEP_INTERVAL_SECONDS = 120.0

_xxh64 = xxhash.xxh64_intdigest
_xxh128 = xxhash.xxh3_128_intdigest
# Chains kept for prompts seen recently: the turns of one agentic conversation repeat its start
# (system prompt, tools, first messages), so the next turn's chain is a lookup, keyed by a 128-bit
# hash of the bytes read (a few µs for 16 KB instead of one xxhash call per block).
CHAIN_CACHE_SIZE = 512


@dataclass(slots=True, frozen=True)
class ApproxPrefixCacheParams:
    """Parameters of ``approx-prefix-cache-producer`` (camelCase in YAML)."""

    auto_tune: bool = True
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    max_prefix_blocks_to_match: int = DEFAULT_MAX_PREFIX_BLOCKS
    max_prefix_tokens_to_match: int = 0
    lru_capacity_per_server: int = DEFAULT_LRU_CAPACITY_PER_SERVER
    auto_tune_capacity_factor: float = 1.0
    block_size: int = field(default=0, metadata=OMIT_UNSET)  # deprecated: a size in characters

    def validate(self) -> str | None:
        if self.block_size_tokens < 0:
            return "blockSizeTokens: must be > 0"
        if self.block_size_tokens == 0 and not self.auto_tune:
            return "blockSizeTokens: must be > 0 when autoTune is false"
        if self.max_prefix_blocks_to_match < 0:
            return "maxPrefixBlocksToMatch: must be >= 0 (0 = no cap)"
        if self.max_prefix_tokens_to_match < 0:
            return "maxPrefixTokensToMatch: must be >= 0"
        if self.lru_capacity_per_server < 0:
            return f"lruCapacityPerServer: must be >= 0 (0 = {DEFAULT_LRU_CAPACITY_PER_SERVER})"
        if not 1.0 <= self.auto_tune_capacity_factor <= 1000.0:
            return (
                f"autoTuneCapacityFactor: must be between 1 and 1000, got {self.auto_tune_capacity_factor:g}"
            )
        if self.block_size < 0:
            return "blockSize: must be >= 0"
        if self.block_size > 0 and self.block_size_tokens == DEFAULT_BLOCK_SIZE_TOKENS:
            return (
                "blockSize: deprecated (a block size in characters); set blockSizeTokens "
                f"(tokens, 4 characters each, e.g. {max(1, self.block_size // CHARS_PER_TOKEN)}) instead"
            )
        return None

    def effective(self) -> ApproxPrefixCacheParams:
        """With the LRU capacity used (0 means the default)."""
        return dataclasses.replace(self, lru_capacity_per_server=self.lru_capacity)

    @property
    def lru_capacity(self) -> int:
        """The per-endpoint capacity used when not auto-tuned (0 means the default)."""
        return (
            self.lru_capacity_per_server
            if self.lru_capacity_per_server > 0
            else DEFAULT_LRU_CAPACITY_PER_SERVER
        )


def hash_seed(target_model: str, cache_salt: str = "") -> int:
    """``xxhash64(target_model ‖ cache_salt)``: the ``h_{-1}`` of every prompt's chain."""
    return _xxh64((target_model + cache_salt).encode())


def prompt_start(body: RequestBody, block_chars: int, max_blocks: int | None) -> bytes:
    """What ``block_hashes`` reads of the prompt: only its first ``max_blocks`` blocks, when capped
    (a long conversation's JSON is not serialised past them)."""
    if max_blocks is None or block_chars <= 0:
        return body.prompt_bytes
    return body.prompt_prefix(max_blocks * block_chars)


def block_hashes(data: bytes, seed: int, block_chars: int, max_blocks: int | None) -> list[int]:
    """Chained block hashes of ``data``: ``h_i = xxhash64(block_i ‖ le64(h_{i-1}))``, ``h_{-1} = seed``.

    Blocks are ``block_chars`` bytes; the trailing partial block is hashed too. Input shorter than one
    block gives no hash. ``max_blocks`` (None = no cap) truncates the input first.
    """
    n = len(data)
    if block_chars <= 0 or n < block_chars:
        return []
    if max_blocks is not None:
        limit = max_blocks * block_chars
        if n > limit:
            data = data[:limit]
            n = limit
    out: list[int] = []
    append = out.append
    prev = seed
    for i in range(0, n, block_chars):
        prev = _xxh64(data[i : i + block_chars] + prev.to_bytes(8, "little"))
        append(prev)
    return out


def _valid_update(v: Any) -> bool:
    """``[hashes, endpoint key, capacity]``: 64-bit hashes, a key, a positive capacity."""
    if not (isinstance(v, list) and len(v) == 3):
        return False
    hashes, key, capacity = v
    return (
        isinstance(hashes, list)
        and isinstance(key, str)
        and bool(key)
        and isinstance(capacity, int)
        and not isinstance(capacity, bool)
        and 0 < capacity < 1 << 32
        and all(type(h) is int and 0 <= h < 1 << 64 for h in hashes)
    )


@dataclass(slots=True)
class _MatchState:
    """What Produce leaves for PreRequest (the reference's PluginState entry)."""

    hashes: list[int]
    groups: Groups
    block_size_tokens: int


@register
class ApproxPrefixCacheProducer(DataProducer, PreRequest):
    """Produce matches the prompt's block hashes against the index; PreRequest adds them to the
    chosen endpoints' LRUs (the primary target and the ``prefill`` target)."""

    type_name = "approx-prefix-cache-producer"
    Params = ApproxPrefixCacheParams
    params: ApproxPrefixCacheParams
    produces = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: ApproxPrefixCacheParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else ApproxPrefixCacheParams()
        super().__init__(name, params, handle)
        self._handle = handle
        self._auto_tune = params.auto_tune
        self._block_size_tokens = params.block_size_tokens or DEFAULT_BLOCK_SIZE_TOKENS
        self._lru_capacity = params.lru_capacity
        self._capacity_factor = params.auto_tune_capacity_factor
        self._state_key = f"{self.type_name}/{name}"
        self.index = PrefixIndex()
        self._hits = _prefix_metrics.track_index(self.index, name, self.type_name)
        self._seeds: dict[tuple[str, str], int] = {}
        self._chains: dict[tuple[int, int, int, int, int | None], tuple[int, ...]] = {}
        self._outbox: list[tuple[list[int], str, int]] | None = None  # HA: updates for the standbys
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_SECONDS
        self._candidates = CandidateMemo()

    # --- request path -------------------------------------------------------------------------

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        bs = self._effective_block_size(endpoints)
        hashes = self.hashes(request, bs)
        total = len(hashes)
        groups = self.index.match_groups(hashes) if total else []
        cycle[self._state_key] = _MatchState(hashes, groups, bs)

        # The holder groups, not a count per endpoint: the mapping answers per endpoint from them
        # and fills itself only when walked; the candidates' set and key maps are kept while the
        # list is the same
        memo = self._candidates
        memo.update(endpoints)
        cycle[PREFIX_CACHE_MATCH_INFO_KEY] = PrefixMatches(
            memo.endpoints,
            memo.members(),
            memo.keys() if groups else (),
            None if groups else {},
            total,
            bs,
            groups,
            memo.key_positions() if groups else None,
            memo.key_set() if groups else frozenset(),
        )

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        state: _MatchState | None = cycle.pop(self._state_key, None)  # per-request state ends here
        primary = result.primary
        if state is None or primary is None or not primary.target_endpoints:
            return
        target = primary.target_endpoints[0]
        target_key = target.metadata.key
        if state.hashes:
            capacity = self._capacity_for(target)
            self.index.add(state.hashes, target_key, capacity)
            outbox = self._outbox
            if outbox is not None:
                outbox.append((state.hashes, target_key, capacity))
            prefill = result.profile_results.get(PREFILL_PROFILE)
            if prefill is not None and prefill.target_endpoints:
                pt = prefill.target_endpoints[0]
                pk = pt.metadata.key
                if pk != target_key:
                    capacity = self._capacity_for(pt)
                    self.index.add(state.hashes, pk, capacity)
                    if outbox is not None:
                        outbox.append((state.hashes, pk, capacity))
        block_bytes = state.block_size_tokens * CHARS_PER_TOKEN
        _prefix_metrics.record_match(
            self._hits, group_count(state.groups, target_key) * block_bytes, len(state.hashes) * block_bytes
        )

    # --- helpers ------------------------------------------------------------------------------

    def hashes(self, request: LLMRequest, block_size_tokens: int) -> list[int]:
        """The request's chained block hashes for a block size in tokens (public for tests/tools)."""
        body = request.body
        seed_key = (request.target_model, body.cache_salt)
        seed = self._seeds.get(seed_key)
        if seed is None:
            if len(self._seeds) >= 4096:
                self._seeds.clear()
            seed = self._seeds[seed_key] = hash_seed(*seed_key)
        block_chars = block_size_tokens * CHARS_PER_TOKEN
        max_blocks = self._max_blocks(block_size_tokens)
        data = prompt_start(body, block_chars, max_blocks)
        if len(data) < 64 * block_chars:  # short prompts: hashing is cheaper than a cache entry
            return block_hashes(data, seed, block_chars, max_blocks)
        key = (_xxh128(data), len(data), seed, block_chars, max_blocks)
        chains = self._chains
        chain = chains.pop(key, None)
        if chain is None:
            chain = tuple(block_hashes(data, seed, block_chars, max_blocks))
            if len(chains) >= CHAIN_CACHE_SIZE:
                del chains[next(iter(chains))]  # the least recently used
        chains[key] = chain
        return list(chain)

    def _max_blocks(self, block_size_tokens: int) -> int | None:
        p = self.params
        if p.max_prefix_tokens_to_match > 0:
            return p.max_prefix_tokens_to_match // block_size_tokens
        return p.max_prefix_blocks_to_match or None

    def _effective_block_size(self, endpoints: list[Endpoint]) -> int:
        if self._auto_tune and endpoints:
            bs = endpoints[0].metrics.cache_block_size
            if bs > 0:
                return bs
        return self._block_size_tokens

    def _capacity_for(self, endpoint: Endpoint) -> int:
        if self._auto_tune:
            n = endpoint.metrics.cache_num_blocks
            if n > 0:
                return int(n * self._capacity_factor)
        return self._lru_capacity

    # --- ReplicatedState (HA standbys mirror the leader's index) --------------------------------

    def start_recording(self) -> None:
        if self._outbox is None:
            self._outbox = []

    def take_updates(self) -> list[Any]:
        outbox = self._outbox
        if not outbox:
            return []
        self._outbox = []
        return outbox

    def apply_updates(self, updates: list[Any]) -> None:
        """``[hashes, endpoint key, capacity]`` records from the leader, in its order."""
        add = self.index.add
        for hashes, key, capacity in updates:
            add(hashes, key, capacity)

    def snapshot_updates(self) -> Iterator[list[Any]]:
        for hashes, key, capacity in self.index.export():
            yield [[hashes, key, capacity]]

    # --- shared with the other replicas (a cross-replica syncer) --------------------------------

    def cross_replica_specs(self) -> list[SharedLog]:
        """Every ``[hashes, endpoint key, capacity]`` a replica adds, applied by all the others."""
        self.start_recording()
        return [
            SharedLog(
                state_key=f"{self.type_name}/{self.name}",
                take=self.take_updates,
                apply=self.apply_updates,
                valid=_valid_update,
            )
        ]

    def reset_replica(self) -> None:
        self.index.clear()

    def remove_endpoint(self, key: str) -> int:
        """Drop an endpoint's entries now (e.g. from a store ``on_remove`` listener)."""
        return self.index.remove_endpoint(key)

    def _sweep(self, now: float) -> None:
        """Drop index entries of endpoints that left the pool (when nobody calls ``remove_endpoint``)."""
        self._next_sweep = now + SWEEP_INTERVAL_SECONDS
        live = list(self._handle.endpoints()) if self._handle is not None else []
        if not live:
            return  # unknown (no handle, or an empty pool): keep the index
        self.index.retain({e.metadata.key for e in live})
