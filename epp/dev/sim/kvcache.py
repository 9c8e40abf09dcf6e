"""A block-level KV cache with vLLM-style automatic prefix caching, for the simulated engine.

It records vLLM's KV-cache events as they happen (``BlockStored`` when prompt blocks become cached,
``BlockRemoved`` when a cached block is evicted, ``AllBlocksCleared`` on a prefix-cache reset) for
the engine to publish; :meth:`KVCache.take_events` hands them over.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.dev.sim.block_hash import BlockHasher

ExtraKeys = tuple[str, ...] | None


@dataclass(slots=True, frozen=True)
class PromptBlocks:
    """A prompt's token ids with the hash and extra keys of each of its full blocks."""

    token_ids: Sequence[int] = ()
    hashes: Sequence[bytes] = ()
    extra_keys: Sequence[ExtraKeys] = ()
    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None
    session_id: str | None = None  # the request's (vLLM and SGLang label their stores with it)


@dataclass(slots=True, frozen=True)
class BlocksStored:
    """Consecutive prompt blocks became cached; ``parent`` is the hash of the block before the first."""

    hashes: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    extra_keys: list[ExtraKeys]
    lora_name: str | None
    lora_id: int | None
    cache_salt: str | None = None  # the request's (SGLang's events carry it)
    session_id: str | None = None  # the request's session (vLLM >= 0.30, SGLang >= 0.5.20)


@dataclass(slots=True, frozen=True)
class BlocksRemoved:
    """Cached blocks were evicted."""

    hashes: list[bytes]


@dataclass(slots=True, frozen=True)
class AllCleared:
    """The prefix cache was reset: no block is cached any more."""


KVEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(slots=True, eq=False)
class Block:
    """One KV block; ``block_hash`` is set for a cached (full prompt) block."""

    block_hash: bytes | None = None
    ref_count: int = 0


@dataclass(slots=True, eq=False)
class Allocation:
    """The blocks one request holds (in prompt order) and how many of its prompt tokens hit the cache."""

    blocks: list[Block] = field(default_factory=list)
    hit_tokens: int = 0
    released: bool = False


class KVCache:
    """Blocks, their reference counts and the LRU list of evictable cached blocks.

    Every full prompt block has vLLM's chained hash (:mod:`epp.dev.sim.block_hash`; the LoRA name and
    cache salt are extra keys). A prompt's longest run of cached blocks from the start is its hit; as
    in vLLM the last prompt token is always recomputed. Hit blocks are shared, the rest are fresh;
    blocks of running requests are pinned, and a finished request's hashed blocks stay cached but
    evictable (tail first, least recently used first). A prompt that cannot get blocks waits; one
    longer than the whole cache gets the whole cache once nothing else runs. Decode takes blocks while
    any are free or evictable; there is no preemption. With ``record_events`` every change of the
    cached set is recorded as a KV event, so the stored minus the removed hashes are always exactly
    the cached ones.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hasher: BlockHasher | None = None,
        *,
        record_events: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher or BlockHasher(block_size)
        if self.hasher.block_size != block_size:
            raise ValueError("the hasher's block size must be the cache's")
        self.record_events = record_events
        self._cached: dict[bytes, Block] = {}  # every hashed block, pinned or evictable
        self._evictable: OrderedDict[bytes, Block] = OrderedDict()  # ref_count == 0, least recent first
        self._pinned = 0  # blocks with ref_count > 0
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------------ inspection

    @property
    def pinned_blocks(self) -> int:
        """Blocks in use by running requests."""
        return self._pinned

    @property
    def cached_blocks(self) -> int:
        """Hashed blocks held, pinned or evictable."""
        return len(self._cached)

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks no running request uses: they can be evicted."""
        return len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks available to a new allocation: empty ones plus evictable cached ones."""
        return self.num_blocks - self._pinned

    @property
    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: blocks in use by running requests over all blocks."""
        return self._pinned / self.num_blocks

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def cached_hashes(self) -> set[bytes]:
        """The hash of every cached block."""
        return set(self._cached)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens."""
        return math.ceil(tokens / self.block_size)

    def prompt_blocks(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> PromptBlocks:
        """A prompt's blocks with their hashes (the LoRA name and cache salt are part of them; the
        session id only labels the events)."""
        hashes, keys = self.hasher.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        return PromptBlocks(
            token_ids, hashes, keys, lora_name, lora_id, cache_salt or None, session_id or None
        )

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """The number of leading blocks of a prompt that are cached (the last token never hits)."""
        limit = max(0, prompt_tokens - 1) // self.block_size
        hits = 0
        for block_hash in hashes[:limit]:
            if block_hash not in self._cached:
                break
            hits += 1
        return hits

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ allocation

    def allocate(self, prompt: PromptBlocks, prompt_tokens: int) -> Allocation | None:
        """Blocks for a prompt (hit blocks shared, the rest fresh), or ``None`` if they do not fit now."""
        hashes = prompt.hashes
        needed = min(self.blocks_for(prompt_tokens), self.num_blocks)
        hits = self.lookup(hashes, prompt_tokens)
        hit_blocks = [self._cached[h] for h in hashes[:hits]]
        newly_pinned = sum(1 for block in hit_blocks if block.ref_count == 0)
        if newly_pinned + (needed - hits) > self.free_blocks:
            return None
        allocation = Allocation(hit_tokens=hits * self.block_size)
        for block in hit_blocks:
            self._pin(block)
            allocation.blocks.append(block)
        stored: list[int] = []  # indexes of the blocks this allocation adds to the cache
        for index in range(hits, needed):
            block = self._take_free()
            if index < len(hashes) and hashes[index] not in self._cached:
                block.block_hash = hashes[index]
                self._cached[hashes[index]] = block
                stored.append(index)
            allocation.blocks.append(block)
        if self.record_events and stored:
            self._record_stored(prompt, stored)
        return allocation

    def grow(self, allocation: Allocation, tokens: int) -> None:
        """Give a decoding request the blocks to hold ``tokens`` tokens, while space allows."""
        while (
            not allocation.released
            and len(allocation.blocks) < self.blocks_for(tokens)
            and self.free_blocks > 0
        ):
            allocation.blocks.append(self._take_free())

    def free(self, allocation: Allocation) -> None:
        """Unpin a request's blocks (idempotent); cached ones become evictable, tail blocks first."""
        if allocation.released:
            return
        allocation.released = True
        for block in reversed(allocation.blocks):
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self._pinned -= 1
            if block.block_hash is not None:
                self._evictable[block.block_hash] = block
        allocation.blocks.clear()

    def reset(self) -> bool:
        """vLLM's prefix-cache reset: forget every cached block, only when no request holds blocks.

        Returns whether it happened (``AllBlocksCleared`` is recorded then).
        """
        if self._pinned:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._evictable.clear()
        if self.record_events:
            self._events.append(AllCleared())
        return True

    def _pin(self, block: Block) -> None:
        if block.ref_count == 0:
            self._pinned += 1
            if block.block_hash is not None:
                self._evictable.pop(block.block_hash, None)
        block.ref_count += 1

    def _take_free(self) -> Block:
        """A fresh pinned block: from empty space, else by evicting the least recently used cached block."""
        if self._pinned + len(self._evictable) >= self.num_blocks:
            evicted_hash, _ = self._evictable.popitem(last=False)
            del self._cached[evicted_hash]
            if self.record_events:
                self._events.append(BlocksRemoved([evicted_hash]))
        block = Block()
        self._pin(block)
        return block

    def _record_stored(self, prompt: PromptBlocks, indexes: list[int]) -> None:
        """One ``BlocksStored`` per run of consecutive newly cached blocks."""
        run: list[int] = []
        for index in indexes:
            if run and index != run[-1] + 1:
                self._events.append(self._stored(prompt, run))
                run = []
            run.append(index)
        self._events.append(self._stored(prompt, run))

    def _stored(self, prompt: PromptBlocks, run: list[int]) -> BlocksStored:
        size = self.block_size
        first, last = run[0], run[-1]
        return BlocksStored(
            hashes=[prompt.hashes[i] for i in run],
            parent=prompt.hashes[first - 1] if first else None,
            token_ids=list(prompt.token_ids[first * size : (last + 1) * size]),
            extra_keys=[prompt.extra_keys[i] for i in run],
            lora_name=prompt.lora_name,
            lora_id=prompt.lora_id,
            cache_salt=prompt.cache_salt,
            session_id=prompt.session_id,
        )
