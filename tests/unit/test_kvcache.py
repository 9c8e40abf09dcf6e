"""Request block keys and the KV-block index (epp.kvcache)."""

from __future__ import annotations

import struct

import pytest
import xxhash

from epp.kvcache import BlockKeyer, KVBlockIndex, block_extras, realign_extras


def _ref_key(parent: int, tokens: list[int], extras: list[str] = ()) -> int:
    """The reference's hashXXH64, written out independently: le64 parent, le32 tokens, le64-len strings."""
    h = xxhash.xxh64()
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    for s in extras:
        b = s.encode()
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    return h.intdigest()


def test_keys_follow_the_reference_xxh64_chain() -> None:
    keyer = BlockKeyer(block_size=4, hash_seed="42", algorithm="xxh64")
    seed = xxhash.xxh64_intdigest(b"42")
    init = _ref_key(seed, [], [""])
    tokens = list(range(100, 111))  # 2 full blocks + 3 tokens
    k0 = _ref_key(init, tokens[0:4])
    k1 = _ref_key(k0, tokens[4:8])
    assert keyer.keys(tokens) == [k0, k1]
    assert keyer.init_key("") == init
    # a namespace (LoRA adapter) changes the init key and so every key
    assert keyer.keys(tokens, namespace="lora-a")[0] == _ref_key(_ref_key(seed, [], ["lora-a"]), tokens[0:4])
    # continuing from a parent
    assert keyer.keys(tokens[4:8], parent=k0) == [k1]


def test_cbor_fnv_is_accepted_and_unknown_algorithms_rejected() -> None:
    assert BlockKeyer(4, algorithm="cbor-fnv").keys([1, 2, 3, 4]) == BlockKeyer(4, algorithm="xxh64").keys(
        [1, 2, 3, 4]
    )
    with pytest.raises(ValueError, match="unsupported hashAlgorithm"):
        BlockKeyer(4, algorithm="sha256")


def test_extras_taint_their_block_and_the_rest_of_the_chain() -> None:
    keyer = BlockKeyer(4)
    tokens = list(range(12))
    plain = keyer.keys(tokens)
    salted = keyer.keys(tokens, extras=block_extras(12, 4, cache_salt="s"))
    assert salted[0] == _ref_key(keyer.init_key(""), tokens[:4], ["s"])
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    mm = block_extras(12, 4, [("img", 5, 4)])
    assert mm == [None, ["img"], ["img"]]
    assert realign_extras([["a"], None, ["b"], None], 2) == [["a"], ["b"]]
    assert realign_extras([["a"]], 2) == [["a"], ["a"]]


def test_index_store_match_remove() -> None:
    idx = KVBlockIndex(size=100, pod_cache_size=4)
    idx.store("ns/a", [11, 12, 13], [1, 2, 3])
    idx.store("ns/b", [21, 22], [1, 2])
    m = idx.match([1, 2, 3, 4], ["ns/a", "ns/b", "ns/c"])
    assert {k: v.blocks for k, v in m.items()} == {"ns/a": 3, "ns/b": 2}
    assert m["ns/a"].tiers == {"gpu": 3}
    # candidates filter the pods
    assert set(idx.match([1, 2], ["ns/b"])) == {"ns/b"}
    # removal by engine key breaks the chain there
    idx.remove("ns/a", [12])
    assert idx.match([1, 2, 3], ["ns/a"])["ns/a"].blocks == 1
    # the parent resolution of the engine-key map
    assert idx.request_key("ns/a", 13) == 3
    assert idx.request_key("ns/a", 12) is None
    # no pod holds the first block: nothing
    assert idx.match([9, 1, 2], ["ns/a", "ns/b"]) == {}


def test_index_tiers_are_weighted_and_counted() -> None:
    idx = KVBlockIndex(tier_weights={"gpu": 1.0, "cpu": 0.5})
    gpu, cpu = idx.tier("GPU"), idx.tier("cpu")
    idx.store("a", [11, 12, 13, 14], [1, 2, 3, 4], gpu)
    idx.store_tier("a", [13, 14], cpu)  # offloaded copies of blocks 3 and 4
    idx.remove("a", [14], gpu)  # block 4 now only on CPU
    m = idx.match([1, 2, 3, 4], ["a"])["a"]
    assert m.blocks == 4
    assert m.score == pytest.approx(3.5)
    assert m.tiers == {"gpu": 3}  # CPU does not hold block 1
    assert idx.holds(4, "a") == ("cpu",)
    assert idx.tier("nvme") == idx.tier_names.index("other")


def test_index_bounds_keys_and_pods_per_key() -> None:
    idx = KVBlockIndex(size=10, pod_cache_size=2)
    for i in range(25):
        idx.store("a", [1000 + i], [i])
    assert len(idx) <= 10
    assert idx.holds(24, "a") == ("gpu",)  # the newest survive
    assert idx.holds(0, "a") == ()
    small = KVBlockIndex(size=10, pod_cache_size=2)
    small.store("p1", [1], [7])
    small.store("p2", [2], [7])
    small.store("p3", [3], [7])  # p1 stored least recently: dropped from key 7
    assert set(small.match([7], ["p1", "p2", "p3"])) == {"p2", "p3"}


def test_clear_pod_and_slot_reuse() -> None:
    idx = KVBlockIndex()
    idx.store("a", [11, 12], [1, 2])
    idx.store("b", [21, 22], [1, 2])
    idx.clear_pod("a")
    assert set(idx.match([1, 2], ["a", "b"])) == {"b"}
    idx.remove_pod("b")
    assert len(idx) == 0
    idx.store("c", [31], [1])  # reuses a freed slot: no stale bits
    assert set(idx.match([1, 2], ["a", "b", "c"])) == {"c"}


def test_a_re_announced_block_is_one_copy_that_one_removal_drops() -> None:
    """vLLM's ``kv_cache_report_mode: "full"`` stores a held block again; it evicts it once."""
    idx = KVBlockIndex()
    idx.store("a", [11, 12], [1, 2])
    idx.store("a", [11, 12], [1, 2])
    assert idx.remove("a", [11]) == 1
    assert idx.holds(1, "a") == () and idx.holds(2, "a") == ("gpu",)
    idx.store("a", [13], [3], tier=idx.tier("CPU"))  # another tier is another copy, removed apart
    idx.store("a", [13], [3])
    assert idx.remove("a", [13], idx.tier("CPU")) == 1
    assert idx.holds(3, "a") == ("gpu",)


@pytest.mark.parametrize(
    ("medium", "tier", "weight"),
    [
        ("GPU", "gpu", 1.0),
        ("CPU", "cpu", 0.8),
        ("CPU_PINNED", "cpu", 0.8),
        ("DISK", "disk", 0.5),
        ("STORAGE", "disk", 0.5),
        ("EXTERNAL", "external", 0.4),
        ("tape", "other", 1.0),
    ],
)
def test_engine_media_map_to_tiers_below_gpu(medium: str, tier: str, weight: float) -> None:
    """SGLang's ``CPU_PINNED``, ``DISK``, ``EXTERNAL`` and vLLM's ``STORAGE`` weigh less than a GPU
    copy, also when the configuration lists only the reference's ``gpu`` and ``cpu``."""
    for idx in (KVBlockIndex(), KVBlockIndex(tier_weights={"gpu": 1.0, "cpu": 0.8})):
        idx.store("a", [11, 12], [1, 2], idx.tier(medium))
        m = idx.match([1, 2], ["a"])["a"]
        assert m.tiers == {tier: 2} and m.score == pytest.approx(2 * weight)
    idx = KVBlockIndex(tier_weights={"gpu": 1.0, "disk": 0.9, "cpu_pinned": 0.7})  # configured wins
    assert (
        idx.tier_names[idx.tier("DISK")] == "disk" and idx.tier_names[idx.tier("CPU_PINNED")] == "cpu_pinned"
    )
    idx.store("a", [11], [1], idx.tier("DISK"))
    assert idx.match([1], ["a"])["a"].score == pytest.approx(0.9)


def test_speculative_entries_expire_or_are_confirmed() -> None:
    idx = KVBlockIndex()
    idx.add_speculative("a", [1, 2], expires_at=10.0)
    assert idx.match([1, 2], ["a"])["a"].tiers == {"speculative": 2}
    idx.store("a", [11], [1])  # a real event replaces the speculative bit of block 1
    assert idx.holds(1, "a") == ("gpu",)
    assert idx.expire(9.0) == 0
    assert idx.expire(10.0) == 1
    assert idx.holds(2, "a") == ()
    assert idx.holds(1, "a") == ("gpu",)


def test_match_with_many_pods_is_per_run() -> None:
    idx = KVBlockIndex(pod_cache_size=64)
    pods = [f"p{i}" for i in range(40)]
    keys = list(range(1, 501))
    for i, p in enumerate(pods):
        n = 10 * (i + 1)
        idx.store(p, [10_000 * (i + 1) + j for j in range(n)], keys[:n])
    m = idx.match(keys, pods)
    assert {p: v.blocks for p, v in m.items()} == {p: 10 * (i + 1) for i, p in enumerate(pods)}
    stats = idx.stats()
    assert stats.keys == 400 and stats.pods == 40 and stats.bytes > 0


def test_engine_key_map_is_bounded_too() -> None:
    idx = KVBlockIndex(size=4)
    idx.store("a", [1, 2, 3], [11, 12, 13])
    idx.remove("b", [1])  # unknown endpoint: nothing
    idx.store("a", [4, 5], [14, 15])  # 5 engine keys > size: the endpoint starts over
    assert idx.stats().engine_keys == 2
    assert idx.holds(15, "a") == ("gpu",) and idx.holds(11, "a") == ()


def test_prefix_key_cache_reuses_a_previous_turn() -> None:
    from epp.kvcache import PrefixKeyCache

    keyer = BlockKeyer(4)
    cache = PrefixKeyCache(keyer, min_blocks=8)
    turn1 = list(range(1000, 1000 + 4 * 40 + 2))  # 40 blocks + a partial one
    assert cache.keys(turn1) == keyer.keys(turn1)
    turn2 = turn1[:-6] + [7] * 50  # the previous turn minus its last tokens, then new ones
    assert cache.keys(turn2) == keyer.keys(turn2)
    assert cache.hits == 1 and cache.reused_blocks == 39
    assert cache.keys(turn2, namespace="lora") == keyer.keys(turn2, namespace="lora")  # not shared
    other = [5] * 4 * 40
    assert cache.keys(other) == keyer.keys(other) and cache.hits == 1
