"""vLLM's prefix-caching block hashes in ``epp sim``, checked against values computed here directly
from the documented payload ``(parent_hash, tuple(block_token_ids), extra_keys)`` with hashlib, pickle,
xxhash and hand-written canonical CBOR, and the seed behaviour of ``PYTHONHASHSEED`` across processes."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import pytest
import xxhash

from epp.dev.sim.block_hash import (
    HASH_ALGORITHMS,
    BlockHasher,
    external_hash,
    hash_function,
    int_hashes_from_env,
    none_hash,
)


def _pickle_sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()


def _chain(digest: object, seed: str, blocks: list[tuple[int, ...]], keys: list[object]) -> list[bytes]:
    """The vLLM chain with ``digest`` (a callable on the payload object)."""
    assert callable(digest)
    parent = digest(seed)
    out = []
    for tokens, extra in zip(blocks, keys, strict=True):
        parent = digest((parent, tokens, extra))
        out.append(parent)
    return out


def test_sha256_is_pickle_of_parent_tokens_and_extra_keys_chained_from_the_seed() -> None:
    hasher = BlockHasher(4, "sha256", seed="0")
    hashes, keys = hasher.hashes(list(range(10)))  # two full blocks, two tokens left over
    expected = _chain(_pickle_sha256, "0", [(0, 1, 2, 3), (4, 5, 6, 7)], [None, None])
    assert hashes == expected
    assert keys == [None, None]
    assert hasher.none_hash == _pickle_sha256("0")


def test_sha256_cbor_matches_hand_encoded_canonical_cbor() -> None:
    hasher = BlockHasher(2, "sha256_cbor", seed="0")
    hashes, _ = hasher.hashes([1, 2, 3, 4])
    seed_hash = hashlib.sha256(b"\x61\x30").digest()  # CBOR text string "0"
    # array(3) [bytes(32) parent, array(2) [1, 2], null]
    first = hashlib.sha256(b"\x83\x58\x20" + seed_hash + b"\x82\x01\x02\xf6").digest()
    second = hashlib.sha256(b"\x83\x58\x20" + first + b"\x82\x03\x04\xf6").digest()
    assert hashes == [first, second]


def test_xxhash_variants_are_xxh3_128_of_the_same_payloads() -> None:
    hashes, _ = BlockHasher(2, "xxhash", seed="s").hashes([7, 8])
    seed_hash = xxhash.xxh3_128_digest(pickle.dumps("s", protocol=5))
    assert hashes == [xxhash.xxh3_128_digest(pickle.dumps((seed_hash, (7, 8), None), protocol=5))]
    cbor_hashes, _ = BlockHasher(2, "xxhash_cbor", seed="0").hashes([1, 2])
    cbor_seed = xxhash.xxh3_128_digest(b"\x61\x30")
    assert cbor_hashes == [xxhash.xxh3_128_digest(b"\x83\x50" + cbor_seed + b"\x82\x01\x02\xf6")]


LORA = ("lora", "adapter", "adapter")  # the sim's adapters have no files: the name is the path


@pytest.mark.parametrize(
    ("version", "hashed"),
    [
        ((0, 30), [("adapter", "salt"), ("adapter",)]),  # bare strings up to vLLM 0.30
        ((0, 31), [(LORA, ("cache_salt", "salt")), (LORA,)]),  # tagged by source since 0.31
        ((0, 34), [(LORA, ("cache_salt", "salt")), (LORA,)]),
    ],
)
def test_lora_name_keys_every_block_and_cache_salt_only_the_first(
    version: tuple[int, int], hashed: list[object]
) -> None:
    hasher = BlockHasher(2, "sha256", seed="0", version=version)
    tokens = [1, 2, 3, 4]
    hashes, keys = hasher.hashes(tokens, lora_name="adapter", cache_salt="salt")
    assert keys == [("adapter", "salt"), ("adapter",)]  # what events carry: untagged
    assert hashes == _chain(_pickle_sha256, "0", [(1, 2), (3, 4)], hashed)
    salted, salted_keys = hasher.hashes(tokens, cache_salt="salt")
    assert salted_keys == [("salt",), None]
    plain, _ = hasher.hashes(tokens)
    assert len({hashes[0], salted[0], plain[0]}) == 3
    assert salted[1] != plain[1]  # the salt changes the whole chain through the first block


def test_an_unset_seed_is_vllm_s_default_and_a_set_one_is_the_seed() -> None:
    """vLLM >= 0.29: ``sha256``/``sha256_cbor`` seed with "vllm-none-hash" (processes agree), the
    ``xxhash`` ones at random; before 0.29 every algorithm took 32 random bytes."""
    assert BlockHasher(2, seed=None).none_hash == _pickle_sha256("vllm-none-hash")
    assert (
        BlockHasher(2, "sha256_cbor", seed=None).none_hash == hashlib.sha256(b"\x6evllm-none-hash").digest()
    )
    assert BlockHasher(2, "xxhash", seed=None).none_hash != BlockHasher(2, "xxhash", seed=None).none_hash
    old = (0, 28)
    assert (
        BlockHasher(2, seed=None, version=old).none_hash != BlockHasher(2, seed=None, version=old).none_hash
    )
    assert len(none_hash("sha256", None, old)) == 32
    assert BlockHasher(2, seed="").none_hash == _pickle_sha256("")  # set but empty is still a seed


_PRINT_HASHES = (
    "from epp.dev.sim.block_hash import BlockHasher, seed_from_env\n"
    "print(BlockHasher(4, 'sha256_cbor', seed_from_env()).hashes(list(range(8)))[0][1].hex())"
)


def _hashes_in_subprocess(seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    result = subprocess.run(
        [sys.executable, "-c", _PRINT_HASHES], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout.strip()


def test_processes_agree_with_the_same_pythonhashseed_and_without_one() -> None:
    first, second = _hashes_in_subprocess("42"), _hashes_in_subprocess("42")
    assert first == second
    assert first == BlockHasher(4, "sha256_cbor", "42").hashes(list(range(8)))[0][1].hex()
    assert _hashes_in_subprocess("43") != first
    unset = _hashes_in_subprocess(None)
    assert unset == _hashes_in_subprocess(None) != first
    assert unset == BlockHasher(4, "sha256_cbor", "vllm-none-hash").hashes(list(range(8)))[0][1].hex()


def test_event_hashes_are_the_low_64_bits_or_the_raw_digest() -> None:
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert external_hash(digest, as_int=False) == digest
    assert int_hashes_from_env({}) is True
    assert int_hashes_from_env({"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}) is False
    with pytest.raises(ValueError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"):
        int_hashes_from_env({"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "yes"})


def test_unknown_algorithm_is_rejected_with_the_known_ones() -> None:
    assert HASH_ALGORITHMS == ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
    with pytest.raises(ValueError, match="sha256_cbor"):
        hash_function("md5")
