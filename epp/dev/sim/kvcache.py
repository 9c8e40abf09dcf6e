"""A block-level KV cache with vLLM-style automatic prefix caching, for the simulated engine."""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def hash_seed(name: str) -> int:
    """The root of a hash chain: derived from the model or adapter name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained hashes of every full block of token ids (a trailing partial block has none)."""
    hashes: list[int] = []
    previous = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        content = array("q", tokens[start : start + block_size]).tobytes()
        digest = hashlib.sha256(previous.to_bytes(8, "big") + content).digest()
        previous = int.from_bytes(digest[:8], "big")
        hashes.append(previous)
    return hashes


@dataclass(slots=True, eq=False)
class Block:
    """One KV block; ``block_hash`` is set for a cached (full prompt) block."""

    block_hash: int | None = None
    ref_count: int = 0


@dataclass(slots=True, eq=False)
class Allocation:
    """The blocks one request holds (in prompt order) and how many of its prompt tokens hit the cache."""

    blocks: list[Block] = field(default_factory=list)
    hit_tokens: int = 0
    released: bool = False


class KVCache:
    """Blocks, their reference counts and the LRU list of evictable cached blocks.

    Every full prompt block gets a chained hash seeded from the model (or adapter) name. A prompt's
    longest run of cached blocks from the start is its hit; as in vLLM the last prompt token is
    always recomputed. Hit blocks are shared, the rest are fresh; blocks of running requests are
    pinned, and a finished request's hashed blocks stay cached but evictable (tail first, least
    recently used first). A prompt that cannot get blocks waits; one longer than the whole cache
    gets the whole cache once nothing else runs. Decode takes blocks while any are free or
    evictable; there is no preemption.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._cached: dict[int, Block] = {}  # every hashed block, pinned or evictable
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # ref_count == 0, least recent first
        self._pinned = 0  # blocks with ref_count > 0

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

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens."""
        return math.ceil(tokens / self.block_size)

    def lookup(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """The number of leading blocks of a prompt that are cached (the last token never hits)."""
        limit = max(0, prompt_tokens - 1) // self.block_size
        hits = 0
        for block_hash in hashes[:limit]:
            if block_hash not in self._cached:
                break
            hits += 1
        return hits

    # ------------------------------------------------------------------ allocation

    def allocate(self, hashes: Sequence[int], prompt_tokens: int) -> Allocation | None:
        """Blocks for a prompt (hit blocks shared, the rest fresh), or ``None`` if they do not fit now."""
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
        for index in range(hits, needed):
            block = self._take_free()
            if index < len(hashes) and hashes[index] not in self._cached:
                block.block_hash = hashes[index]
                self._cached[hashes[index]] = block
            allocation.blocks.append(block)
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
        block = Block()
        self._pin(block)
        return block
