"""vLLM's prefix-caching block hashes, so the simulator's KV events carry what a real vLLM would send.

A block's hash is ``hash_fn((parent_hash, tuple(block_token_ids), extra_keys))``. The parent of the
first block is the seed hash ``hash_fn(PYTHONHASHSEED)``; with the variable unset vLLM >= 0.29 uses
``hash_fn("vllm-none-hash")`` for ``sha256`` and ``sha256_cbor`` (so processes agree) and a random
seed for the ``xxhash`` ones, older vLLM 32 random bytes. ``extra_keys`` is ``None`` or a tuple of
the LoRA adapter (every block) followed by the request's ``cache_salt`` (first block only): tagged
in the hash since vLLM 0.31 (``("lora", name, path)``, ``("cache_salt", salt)``), bare strings
before; events always carry the bare strings. ``--prefix-caching-hash-algo`` picks the
serialisation and digest: ``sha256`` (pickle, vLLM's default), ``sha256_cbor`` (canonical CBOR),
``xxhash`` (pickle, XXH3-128) or ``xxhash_cbor``. Events carry the digest's low 64 bits as an int
unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (then the raw bytes).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2
import xxhash

HashFunction = Callable[[Any], bytes]

DEFAULT_HASH_ALGORITHM = "sha256"

SEED_ENV = "PYTHONHASHSEED"

INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"

_UINT64_MASK = (1 << 64) - 1

VllmVersion = tuple[int, int]

NEWEST_VLLM: VllmVersion = (0, 34)
"""The vLLM whose hashing the simulator follows unless told an older one."""

FIXED_SEED_SINCE: VllmVersion = (0, 29)
TAGGED_KEYS_SINCE: VllmVersion = (0, 31)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_RANDOM_SEEDED = frozenset({"xxhash", "xxhash_cbor"})  # not collision resistant: seeded at random


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(_pickled(value)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(_cbor(value)).digest()


def _xxhash_pickle(value: Any) -> bytes:
    return xxhash.xxh3_128_digest(_pickled(value))


def _xxhash_cbor(value: Any) -> bytes:
    return xxhash.xxh3_128_digest(_cbor(value))


HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}
"""``--prefix-caching-hash-algo`` values and their hash functions."""

HASH_ALGORITHMS = tuple(HASH_FUNCTIONS)


def hash_function(algorithm: str) -> HashFunction:
    """The hash function of an algorithm name; ``ValueError`` names the known ones."""
    try:
        return HASH_FUNCTIONS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown prefix-caching hash algorithm {algorithm!r}; known: {', '.join(HASH_ALGORITHMS)}"
        ) from None


def seed_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The hash seed vLLM uses: ``PYTHONHASHSEED`` as a string, ``None`` when unset."""
    return (os.environ if environ is None else environ).get(SEED_ENV)


def none_hash(algorithm: str, seed: str | None, version: VllmVersion = NEWEST_VLLM) -> bytes:
    """The parent hash of every first block: ``hash_fn(seed)``; without a seed vLLM ``version``'s
    default (see the module docstring)."""
    if seed is None:
        if version < FIXED_SEED_SINCE:
            return os.urandom(32)
        seed = os.urandom(32).hex() if algorithm in _RANDOM_SEEDED else DEFAULT_NONE_HASH_SEED
    return hash_function(algorithm)(seed)


def int_hashes_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether events carry int block hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, default 1)."""
    value = (os.environ if environ is None else environ).get(INT_HASHES_ENV, "1")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{INT_HASHES_ENV} must be an integer (0 or 1), got {value!r}") from None


def external_hash(block_hash: bytes, *, as_int: bool = True) -> int | bytes:
    """A block hash as events carry it: the low 64 bits of the digest as an int, or the raw bytes."""
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & _UINT64_MASK


def extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> tuple[str, ...] | None:
    """The extra keys of a block as events carry them: the LoRA name, then the cache salt on the
    first block."""
    keys: list[str] = []
    if lora_name is not None:
        keys.append(lora_name)
    if block_index == 0 and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def tagged_extra_keys(
    block_index: int, lora_name: str | None, lora_path: str | None, cache_salt: str | None
) -> tuple[tuple[str, ...], ...] | None:
    """The extra keys of a block as vLLM >= 0.31 hashes them: each tagged with its source."""
    keys: list[tuple[str, ...]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path if lora_path is not None else lora_name))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


class BlockHasher:
    """Chained block hashes of token ids with one algorithm and one seed (fixed for its lifetime),
    as vLLM ``version`` computes them."""

    __slots__ = ("_hash", "algorithm", "block_size", "none_hash", "version")

    def __init__(
        self,
        block_size: int,
        algorithm: str = DEFAULT_HASH_ALGORITHM,
        seed: str | None = None,
        version: VllmVersion = NEWEST_VLLM,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.algorithm = algorithm
        self.version = version
        self._hash = hash_function(algorithm)
        self.none_hash = none_hash(algorithm, seed, version)

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], keys: tuple[Any, ...] | None = None
    ) -> bytes:
        """One block's hash; a missing (or empty) parent means the seed hash, as in vLLM."""
        return self._hash((parent or self.none_hash, tuple(token_ids), keys))

    def hashes(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        lora_path: str | None = None,
    ) -> tuple[list[bytes], list[tuple[str, ...] | None]]:
        """The hashes and (event) extra keys of every full block of ``token_ids`` (a partial tail
        has none); ``lora_path`` (default: the name) enters the tagged LoRA key."""
        size = self.block_size
        tagged = self.version >= TAGGED_KEYS_SINCE
        hashes: list[bytes] = []
        keys_per_block: list[tuple[str, ...] | None] = []
        parent: bytes | None = None
        for index in range(len(token_ids) // size):
            keys = extra_keys(index, lora_name, cache_salt)
            hashed: tuple[Any, ...] | None = (
                tagged_extra_keys(index, lora_name, lora_path, cache_salt) if tagged else keys
            )
            parent = self.hash_block(parent, token_ids[index * size : (index + 1) * size], hashed)
            hashes.append(parent)
            keys_per_block.append(keys)
        return hashes, keys_per_block
