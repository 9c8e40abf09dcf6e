"""``burst-prefix-cache-producer`` (alpha): co-locates bursts of prompt-sharing requests.

Requests arriving within ``windowDurationMs`` wait for each other and are assigned jointly:
identical prompts (a group) go to one replica (at most ``maxPerReplica`` each), prompts sharing at
least ``minColocateBlocks`` leading blocks join a replica already holding that prefix while it is
under its fair share, everything else is balanced by request count or prefix blocks
(``balanceBy``). The producer writes a full prefix match on the assigned replica and zero
elsewhere, for ``prefix-cache-scorer``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from epp.framework import (
    CycleState,
    DataProducer,
    Endpoint,
    Handle,
    LLMRequest,
    Stability,
    register,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.plugins.producers.approx_prefix_cache import (
    CHARS_PER_TOKEN,
    block_hashes,
    hash_seed,
    prompt_start,
)

__all__ = ["BurstPrefixCacheParams", "BurstPrefixCacheProducer", "assign"]

UNLIMITED = -1
DEFAULT_MAX_PREFIX_BLOCKS = 2048
MAX_WINDOW_MS = 10000
PRODUCE_TIMEOUT_MARGIN_SECONDS = 0.3
BALANCE_MODES = ("requests", "tokens")


@dataclass(slots=True, frozen=True)
class BurstPrefixCacheParams:
    window_duration_ms: int = 100
    max_per_replica: int = UNLIMITED
    block_size_tokens: int = 64
    max_prefix_tokens_to_match: int = 0
    min_colocate_blocks: int = 0
    max_batch_size: int = 1000
    balance_by: str = "requests"

    def validate(self) -> str | None:
        if not 0 < self.window_duration_ms <= MAX_WINDOW_MS:
            return f"windowDurationMs: must be in 1..{MAX_WINDOW_MS}, got {self.window_duration_ms}"
        if self.max_per_replica != UNLIMITED and self.max_per_replica < 1:
            return f"maxPerReplica: must be -1 (unlimited) or >= 1, got {self.max_per_replica}"
        if self.block_size_tokens <= 0:
            return f"blockSizeTokens: must be > 0, got {self.block_size_tokens}"
        if self.max_prefix_tokens_to_match < 0:
            return f"maxPrefixTokensToMatch: must be >= 0, got {self.max_prefix_tokens_to_match}"
        if 0 < self.max_prefix_tokens_to_match < self.block_size_tokens:
            return (
                f"maxPrefixTokensToMatch: must be 0 or >= blockSizeTokens ({self.block_size_tokens}), "
                f"got {self.max_prefix_tokens_to_match}; a smaller positive value yields zero prefix blocks"
            )
        if self.min_colocate_blocks < 0:
            return f"minColocateBlocks: must be >= 0, got {self.min_colocate_blocks}"
        if self.max_batch_size != UNLIMITED and self.max_batch_size < 1:
            return f"maxBatchSize: must be -1 (unlimited) or >= 1, got {self.max_batch_size}"
        if self.balance_by not in ("", *BALANCE_MODES):
            return f'balanceBy: must be "requests" or "tokens", got {self.balance_by!r}'
        return None


class _Entry:
    """One request in a window; ``assigned`` is filled when the window seals (None: no affinity)."""

    __slots__ = ("assigned", "hashes", "pods")

    def __init__(self, hashes: list[int], pods: list[Endpoint]) -> None:
        self.hashes = hashes
        self.pods = pods
        self.assigned: Endpoint | None = None


class _Batch:
    __slots__ = ("entries", "sealed")

    def __init__(self, sealed: asyncio.Future[None]) -> None:
        self.entries: list[_Entry] = []
        self.sealed = sealed


def _running(e: Endpoint) -> int:
    return e.metrics.running_requests_size


def _prefer(a: Endpoint, b: Endpoint | None, load: dict[str, int]) -> bool:
    """Whether ``a`` beats ``b``: lower batch load, then fewer running requests, then lower key."""
    if b is None:
        return True
    ka, kb = a.metadata.key, b.metadata.key
    la, lb = load.get(ka, 0), load.get(kb, 0)
    if la != lb:
        return la < lb
    ra, rb = _running(a), _running(b)
    if ra != rb:
        return ra < rb
    return ka < kb


def _least_loaded(
    replicas: list[Endpoint], per_replica: dict[str, int], k: int, load: dict[str, int]
) -> Endpoint:
    best: Endpoint | None = None
    for r in replicas:
        if k != UNLIMITED and per_replica.get(r.metadata.key, 0) >= k:
            continue
        if _prefer(r, best, load):
            best = r
    if best is None:  # every replica at the per-group cap
        for r in replicas:
            if _prefer(r, best, load):
                best = r
    assert best is not None
    return best


class _Index:
    """Which replicas hold each block placed in this window (a whole prefix is added at once)."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}

    def add(self, hashes: list[int], replica: str) -> None:
        for h in hashes:
            self.holders.setdefault(h, set()).add(replica)

    def longest_prefix(self, hashes: list[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in hashes:
            holders = self.holders.get(h)
            if not holders:
                break
            for name in holders:
                out[name] = out.get(name, 0) + 1
        return out


def _place(
    members: list[_Entry],
    replicas: list[Endpoint],
    k: int,
    min_colocate: int,
    max_share: int,
    cost: int,
    index: _Index,
    load: dict[str, int],
    by_tokens: bool,
) -> None:
    """Place one unit (an identical group, or one prefix-sharing request)."""
    hashes = members[0].hashes
    prefer_match = min_colocate > 0
    matches = index.longest_prefix(hashes) if prefer_match or by_tokens else {}
    per_replica: dict[str, int] = {}
    i = 0
    while i < len(members):
        target: Endpoint | None = None
        if prefer_match:  # the replica sharing the longest prefix, under its fair share
            best_match = 0
            for r in replicas:
                key = r.metadata.key
                if k != UNLIMITED and per_replica.get(key, 0) >= k:
                    continue
                if load.get(key, 0) >= max_share:
                    continue
                m = matches.get(key, 0)
                if m < min_colocate:
                    continue
                if target is None or m > best_match or (m == best_match and _prefer(r, target, load)):
                    target, best_match = r, m
        if target is None:
            target = _least_loaded(replicas, per_replica, k, load)
        key = target.metadata.key
        run = len(members) - i
        if k != UNLIMITED:
            run = min(run, max(1, k - per_replica.get(key, 0)))
        for member in members[i : i + run]:
            member.assigned = target
        first_touch = per_replica.get(key, 0) == 0
        per_replica[key] = per_replica.get(key, 0) + run
        if not by_tokens:
            load[key] = load.get(key, 0) + run
        elif first_touch:  # the prefix is prefilled once per replica, minus what it already holds
            load[key] = load.get(key, 0) + max(0, cost - matches.get(key, 0))
        i += run
        prefer_match = False  # only the unit's first replica gets the prefix preference
    for member in members:
        if member.assigned is not None:
            index.add(hashes, member.assigned.metadata.key)


def assign(entries: list[_Entry], k: int, min_colocate: int, by_tokens: bool) -> None:
    """Steer each entry of a sealed window to a replica (``_Entry.assigned``)."""
    groups: dict[tuple[int, ...], list[_Entry]] = {}
    replicas: list[Endpoint] | None = None
    for e in entries:
        if not e.hashes:
            continue
        groups.setdefault(tuple(e.hashes), []).append(e)
        if replicas is None:
            replicas = e.pods
    if not replicas:
        return
    shared: set[tuple[int, ...]] = set()
    if min_colocate > 0:  # single requests sharing >= min_colocate leading blocks with another one
        count: dict[tuple[int, ...], int] = {}
        for key, members in groups.items():
            if len(key) >= min_colocate:
                sig = key[:min_colocate]
                count[sig] = count.get(sig, 0) + len(members)
        shared = {key for key in groups if len(key) >= min_colocate and count[key[:min_colocate]] >= 2}
    group_units = [key for key, members in groups.items() if len(members) >= 2]
    single_units = [key for key, members in groups.items() if len(members) == 1 and key in shared]
    if not group_units and not single_units:
        return
    group_units.sort(key=len, reverse=True)  # longest prefix first (stable)
    single_units.sort(key=len, reverse=True)
    units = group_units + single_units
    total = sum(len(key) if by_tokens else len(groups[key]) for key in units)
    max_share = -(-total // len(replicas))  # ceil: the fair share per replica
    index = _Index()
    load: dict[str, int] = {}
    for key in units:
        _place(groups[key], replicas, k, min_colocate, max_share, len(key), index, load, by_tokens)


@register
class BurstPrefixCacheProducer(DataProducer):
    type_name = "burst-prefix-cache-producer"
    stability = Stability.ALPHA
    Params = BurstPrefixCacheParams
    params: BurstPrefixCacheParams
    produces = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: BurstPrefixCacheParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else BurstPrefixCacheParams()
        super().__init__(name, params, handle)
        self._window = params.window_duration_ms / 1000.0
        self.produce_timeout = self._window + PRODUCE_TIMEOUT_MARGIN_SECONDS
        self._block_chars = params.block_size_tokens * CHARS_PER_TOKEN
        self._max_blocks = (
            params.max_prefix_tokens_to_match // params.block_size_tokens
            if params.max_prefix_tokens_to_match > 0
            else DEFAULT_MAX_PREFIX_BLOCKS
        )
        self._by_tokens = params.balance_by == "tokens"
        self._batch: _Batch | None = None
        self.last_wait = 0.0  # seconds the last request waited for its window (for tests and debugging)

    def hashes(self, request: LLMRequest) -> list[int]:
        body = request.body
        seed = hash_seed(request.target_model, body.cache_salt)
        return block_hashes(
            prompt_start(body, self._block_chars, self._max_blocks), seed, self._block_chars, self._max_blocks
        )

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        hashes = self.hashes(request)
        entry = _Entry(hashes, endpoints)
        batch = self._batch
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._batch = _Batch(loop.create_future())
            loop.call_later(self._window, self._seal, batch)
        limit = self.params.max_batch_size
        if limit != UNLIMITED and len(batch.entries) >= limit:
            raise RuntimeError(f"burst prefix batch full: maxBatchSize {limit} reached")
        batch.entries.append(entry)
        t0 = time.monotonic()
        await asyncio.shield(batch.sealed)  # a request cut by the producers' budget leaves the batch intact
        self.last_wait = time.monotonic() - t0
        total = len(hashes)
        bs = self.params.block_size_tokens
        zero = PrefixCacheMatchInfo(0, total, bs)
        assigned = entry.assigned
        if assigned is None:
            cycle[PREFIX_CACHE_MATCH_INFO_KEY] = dict.fromkeys(endpoints, zero)
            return
        full = PrefixCacheMatchInfo(total, total, bs)
        key = assigned.metadata.key  # the endpoint set may have changed since: match by key
        cycle[PREFIX_CACHE_MATCH_INFO_KEY] = {e: full if e.metadata.key == key else zero for e in endpoints}

    def _seal(self, batch: _Batch) -> None:
        if self._batch is batch:
            self._batch = None
        p = self.params
        try:
            assign(batch.entries, p.max_per_replica, p.min_colocate_blocks, self._by_tokens)
        finally:
            if not batch.sealed.done():
                batch.sealed.set_result(None)
