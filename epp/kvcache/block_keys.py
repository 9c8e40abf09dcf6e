"""Request block keys: the chained per-block hashes under which the KV-block index stores blocks.

Both sides are computed by epp from token ids (the lookup from a request's prompt, the ingestion
from a BlockStored event's ``token_ids``), so the keys never leave the process. The chain is the
reference's ``xxh64`` layout: an init key ``H(seed_hash, [], [namespace])``, then per full block
``H(parent, block tokens, extras)`` where ``H`` is one XXH64 digest over ``le64(parent)``, the
tokens as ``le32`` each, and every extra string as ``le64(len) ‖ utf-8 bytes``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

__all__ = [
    "HASH_ALGORITHMS",
    "BlockKeyer",
    "PrefixKeyCache",
    "block_extras",
    "realign_extras",
    "token_bytes",
]

HASH_ALGORITHMS = ("cbor-fnv", "xxh64")
"""Accepted ``hashAlgorithm`` values ("" = the default, ``cbor-fnv``); both use the xxh64 chain."""

_xxh64 = xxhash.xxh64_intdigest
_MASK32 = 0xFFFFFFFF
_SWAP = sys.byteorder != "little"
_MAX_NAMESPACES = 1024

Extras = Sequence[Sequence[str] | None] | None
"""Per block, the strings that taint its key (multimodal identifiers, the cache salt), or None."""


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The ids as consecutive little-endian uint32 (ids outside uint32 are truncated, as the
    reference's ``uint32`` conversion). ``TypeError`` for a non-integer id."""
    try:
        arr = array("I", token_ids)
    except OverflowError:
        arr = array("I", [t & _MASK32 for t in token_ids])
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def _extra_bytes(extras: Sequence[str]) -> bytes:
    out = bytearray()
    for s in extras:
        b = s.encode()
        out += len(b).to_bytes(8, "little")
        out += b
    return bytes(out)


class BlockKeyer:
    """Turns token ids into chained block keys (full blocks only).

    ``algorithm``: ``cbor-fnv`` (the reference's default) or ``xxh64``; both compute the xxh64
    chain, since the keys stay inside epp. ``hash_seed`` seeds the chain (the reference's
    ``hashSeed``); ``namespace`` separates key spaces ("" for the base model, the adapter name for
    LoRA blocks).
    """

    __slots__ = ("_init", "algorithm", "block_size", "hash_seed", "seed_hash")

    def __init__(self, block_size: int = 16, hash_seed: str = "", algorithm: str = "cbor-fnv") -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be > 0, got {block_size}")
        if algorithm not in ("", *HASH_ALGORITHMS):
            raise ValueError(
                f"unsupported hashAlgorithm {algorithm!r}: accepted values are "
                + " and ".join(repr(a) for a in HASH_ALGORITHMS)
            )
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.algorithm = algorithm or "cbor-fnv"
        self.seed_hash = _xxh64(hash_seed.encode())
        self._init: dict[str, int] = {}

    def init_key(self, namespace: str = "") -> int:
        """The chain's first parent for ``namespace``."""
        key = self._init.get(namespace)
        if key is None:
            if len(self._init) >= _MAX_NAMESPACES:
                self._init.clear()
            key = self._init[namespace] = _xxh64(
                self.seed_hash.to_bytes(8, "little") + _extra_bytes((namespace,))
            )
        return key

    def keys(
        self,
        token_ids: Sequence[int] | bytes,
        *,
        namespace: str = "",
        parent: int | None = None,
        extras: Extras = None,
    ) -> list[int]:
        """The keys of the full blocks of ``token_ids`` (or their ``token_bytes``), chained from
        ``parent`` (None: the namespace's init key). ``extras``: per block, strings mixed into its key."""
        data = token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids)
        step = self.block_size * 4
        n = len(data) // step
        if n == 0:
            return []
        prev = self.init_key(namespace) if parent is None else parent
        out: list[int] = [0] * n
        if not extras or not any(extras):
            h = _xxh64
            for i in range(n):
                off = i * step
                prev = h(prev.to_bytes(8, "little") + data[off : off + step])
                out[i] = prev
            return out
        for i in range(n):
            off = i * step
            block = prev.to_bytes(8, "little") + data[off : off + step]
            ex = extras[i] if i < len(extras) else None
            if ex:
                block += _extra_bytes(ex)
            prev = _xxh64(block)
            out[i] = prev
        return out


def block_extras(
    n_tokens: int, block_size: int, mm: Sequence[tuple[str, int, int]] = (), cache_salt: str = ""
) -> list[list[str] | None] | None:
    """Per full block, the multimodal identifiers whose placeholder ``(hash, offset, length)``
    overlaps it (in placeholder order), and the cache salt appended to block 0; None when nothing
    taints any block (the reference's ``ComputeBlockExtraFeatures`` + ``foldCacheSalt``)."""
    n_blocks = n_tokens // block_size if block_size > 0 else 0
    if n_blocks == 0 or (not mm and not cache_salt):
        return None
    out: list[list[str] | None] = [None] * n_blocks
    for h, offset, length in sorted(mm, key=lambda item: item[1]):
        if length <= 0:
            continue
        first = max(offset, 0) // block_size
        last = min((offset + length - 1) // block_size, n_blocks - 1)
        for b in range(first, last + 1):
            lst = out[b]
            if lst is None:
                out[b] = [h]
            else:
                lst.append(h)
    if cache_salt:
        lst = out[0]
        if lst is None:
            out[0] = [cache_salt]
        else:
            lst.append(cache_salt)
    return out


def realign_extras(extras: Sequence[Sequence[str] | None], n_blocks: int) -> list[list[str] | None] | None:
    """Engine-block extras onto ``n_blocks`` request blocks: replicated when engine blocks are
    larger, merged (in order) when smaller (the reference's ``realignExtraFeatures``)."""
    if n_blocks == 0:
        return None
    m = len(extras)
    if m == 0:
        return None
    if m == n_blocks:
        return [list(e) if e else None for e in extras]
    out: list[list[str] | None] = [None] * n_blocks
    if m < n_blocks:
        for i in range(n_blocks):
            e = extras[i * m // n_blocks]
            out[i] = list(e) if e else None
        return out
    for i, e in enumerate(extras):
        if not e:
            continue
        j = i * n_blocks // m
        lst = out[j]
        if lst is None:
            out[j] = list(e)
        else:
            lst.extend(e)
    return out


class _Recent:
    __slots__ = ("data", "keys", "namespace")

    def __init__(self, data: bytes, keys: list[int], namespace: str) -> None:
        self.data = data
        self.keys = keys
        self.namespace = namespace


class PrefixKeyCache:
    """The keys of recent long prompts: a prompt that extends one of them (the next turn of a
    conversation: all but its last blocks equal) hashes only its new blocks.

    Bounded by ``max_entries`` prompts and ``max_bytes`` of token bytes; a prompt extending an
    entry replaces it. For the request path of one thread.
    """

    def __init__(
        self, keyer: BlockKeyer, max_entries: int = 16, max_bytes: int = 32 << 20, min_blocks: int = 64
    ) -> None:
        self.keyer = keyer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_blocks = min_blocks
        self._recent: list[_Recent] = []  # oldest first
        self._bytes = 0
        self.hits = 0
        self.reused_blocks = 0

    def keys(self, token_ids: Sequence[int], namespace: str = "") -> list[int]:
        keyer = self.keyer
        data = token_bytes(token_ids)
        step = keyer.block_size * 4
        n = len(data) // step
        if n < self.min_blocks:
            return keyer.keys(data, namespace=namespace)
        best: _Recent | None = None
        best_len = 0
        for entry in reversed(self._recent):
            if entry.namespace != namespace:
                continue
            m = min(len(entry.keys), n)
            view = memoryview(entry.data)
            lo = max(0, m - 2)
            if not data.startswith(view[: lo * step]):
                continue
            while lo < m and data.startswith(view[: (lo + 1) * step]):
                lo += 1
            if lo > best_len:
                best, best_len = entry, lo
                if lo == m:
                    break
        if best is None or best_len < self.min_blocks // 2:
            keys = keyer.keys(data, namespace=namespace)
        else:
            self.hits += 1
            self.reused_blocks += best_len
            keys = best.keys[:best_len]
            keys += keyer.keys(data[best_len * step :], parent=keys[-1])
            if best_len >= len(best.keys) - 2:  # superseded by this prompt
                self._recent.remove(best)
                self._bytes -= len(best.data)
        self._recent.append(_Recent(data, keys, namespace))
        self._bytes += len(data)
        while self._recent and (len(self._recent) > self.max_entries or self._bytes > self.max_bytes):
            old = self._recent.pop(0)
            self._bytes -= len(old.data)
        return keys
