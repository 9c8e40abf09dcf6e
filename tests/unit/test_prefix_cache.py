"""Approximate prefix cache: hashing, the index, the producer and ``prefix-cache-scorer`` (D5, D6)."""

from __future__ import annotations

import gc
import itertools
import struct
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from epp.config.loader import load_config
from epp.framework import (
    ApiKind,
    ConfigError,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    ProfileRunResult,
    RequestBody,
    SchedulingResult,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.params import decode_params
from epp.plugins.producers._prefix_index import PrefixIndex
from epp.plugins.producers.approx_prefix_cache import (
    ApproxPrefixCacheParams,
    ApproxPrefixCacheProducer,
    block_hashes,
    hash_seed,
)
from epp.plugins.scorers.prefix_cache import PrefixCacheScorer, PrefixCacheScorerParams
from tests.unit.factories import StubHandle, completions, endpoints

# --- helpers -------------------------------------------------------------------------------------


def expected_chain(data: bytes, model: str, salt: str, block_chars: int) -> list[int]:
    """The reference chain, computed independently with xxhash's streaming API."""
    seed = xxhash.xxh64()
    seed.update(model.encode())
    seed.update(salt.encode())
    prev = seed.intdigest()
    out = []
    for i in range(0, len(data), block_chars):
        h = xxhash.xxh64()
        h.update(data[i : i + block_chars])
        h.update(struct.pack("<Q", prev))
        prev = h.intdigest()
        out.append(prev)
    return out


def completion(prompt: str, model: str = "m", salt: str | None = None, rid: str = "r") -> LLMRequest:
    salted: dict[str, Any] = {"cache_salt": salt} if salt is not None else {}
    return completions(prompt, model=model, request_id=rid, **salted)


def result(primary: Endpoint, prefill: Endpoint | None = None) -> SchedulingResult:
    results: dict[str, ProfileRunResult | None] = {"decode": ProfileRunResult([primary])}
    if prefill is not None:
        results["prefill"] = ProfileRunResult([prefill])
    return SchedulingResult(results, "decode")


def producer(handle: StubHandle | None = None, **params: object) -> ApproxPrefixCacheProducer:
    p = decode_params(ApproxPrefixCacheParams, params, "parameters")
    return ApproxPrefixCacheProducer("approx-prefix-cache-producer", p, handle)


# small blocks keep the prompts readable: 4 tokens = 16 characters per block
SMALL = {"autoTune": False, "blockSizeTokens": 4}


async def route(
    prod: ApproxPrefixCacheProducer, req: LLMRequest, eps: list[Endpoint], target: Endpoint
) -> CycleState:
    cycle = CycleState()
    await prod.produce(cycle, req, eps)
    prod.pre_request(cycle, req, result(target))
    return cycle


def infos(cycle: CycleState, eps: list[Endpoint]) -> list[tuple[int, int]]:
    m = cycle[PREFIX_CACHE_MATCH_INFO_KEY]
    return [(m[e].match_blocks, m[e].total_blocks) for e in eps]


# --- hashing -------------------------------------------------------------------------------------


def test_hash_chain_matches_independent_xxhash_including_partial_block() -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 3).encode()  # 135 bytes: 2 full + partial
    got = block_hashes(text, hash_seed("llama", "salt"), 64, None)
    assert got == expected_chain(text, "llama", "salt", 64)
    assert len(got) == 3  # the trailing 7-byte block is hashed too


def test_producer_hashes_prompt_text_with_model_seed() -> None:
    prompt = "x" * 100 + "y" * 20  # 120 chars, block = 16 chars -> 7 full blocks + 8-char tail
    prod = producer(**SMALL)
    assert prod.hashes(completion(prompt, model="m1"), 4) == expected_chain(prompt.encode(), "m1", "", 16)
    assert len(prod.hashes(completion(prompt), 4)) == 8


def test_short_prompt_gets_no_hashes() -> None:
    prod = producer(**SMALL)
    assert prod.hashes(completion("x" * 15), 4) == []  # one char short of a block: no hash
    assert len(prod.hashes(completion("x" * 16), 4)) == 1


def test_model_and_cache_salt_change_every_hash() -> None:
    prompt = "shared system prompt " * 4
    prod = producer(**SMALL)
    base = prod.hashes(completion(prompt, model="a"), 4)
    other_model = prod.hashes(completion(prompt, model="b"), 4)
    salted = prod.hashes(completion(prompt, model="a", salt="tenant-1"), 4)
    assert set(base).isdisjoint(other_model)
    assert set(base).isdisjoint(salted)
    assert hash_seed("a", "tenant-1") == xxhash.xxh64_intdigest(b"atenant-1")
    assert salted == expected_chain(prompt.encode(), "a", "tenant-1", 16)


def test_max_blocks_and_max_tokens_truncate() -> None:
    prompt = "z" * 16 * 10
    full = producer(**SMALL).hashes(completion(prompt), 4)
    assert len(full) == 10
    assert producer(**SMALL, maxPrefixBlocksToMatch=3).hashes(completion(prompt), 4) == full[:3]
    # maxPrefixTokensToMatch overrides the block cap: 20 tokens / 4 per block = 5 blocks
    capped = producer(**SMALL, maxPrefixBlocksToMatch=3, maxPrefixTokensToMatch=20)
    assert capped.hashes(completion(prompt), 4) == full[:5]


# --- the index -----------------------------------------------------------------------------------


def test_match_stops_at_first_block_nobody_holds() -> None:
    ix = PrefixIndex()
    ix.add([1, 2, 4], "A", 100)
    ix.add([1], "B", 100)
    assert ix.match([1, 2, 3, 4]) == {"A": 2, "B": 1}  # 4 is held by A but 3 breaks the chain
    assert ix.match([9, 1, 2]) == {}


def test_lru_eviction_removes_endpoint_from_hash_holders() -> None:
    ix = PrefixIndex()
    ix.add([10], "F", 100)
    ix.add([10, 11, 12], "E", 2)  # inserted tail first: 12, 11, 10 -> 12 (the tail) is evicted
    assert ix.holders(12) == frozenset()
    assert ix.holders(11) == {"E"}
    assert ix.holders(10) == {"E", "F"}
    ix.add([20, 21], "E", 2)  # evicts 11 and 10 from E; F still holds 10
    assert ix.holders(11) == frozenset()
    assert ix.holders(10) == {"F"}
    assert ix.match([10, 11]) == {"F": 1}


def test_capacity_is_respected_and_fixed_at_creation() -> None:
    ix = PrefixIndex()
    ix.add(list(range(50)), "E", 8)
    assert ix.entries("E") == 8
    ix.add(list(range(100, 150)), "E", 1000)  # capacity does not change once the LRU exists
    assert ix.entries("E") == 8
    assert ix.capacity("E") == 8
    ix.add(list(range(10)), "F", 5)
    assert ix.size() == 13
    assert ix.hash_count() == 13


def test_touching_a_hash_makes_it_most_recent() -> None:
    ix = PrefixIndex()
    ix.add([1, 2], "E", 3)  # order (oldest first): 2, 1
    ix.add([3], "E", 3)  # 2, 1, 3
    ix.add([2], "E", 3)  # 1, 3, 2
    ix.add([4], "E", 3)  # evicts 1
    assert ix.holders(1) == frozenset()
    assert ix.holders(2) == {"E"}


def _chain(root: int, diverge: int, variant: int, length: int) -> list[int]:
    """Block hashes of a prompt: a path in a tree, shared with same-root prompts up to ``diverge``."""
    return [
        xxhash.xxh64_intdigest(
            f"{root}/{i}".encode() if i < diverge else f"{root}/{diverge}/{variant}/{i}".encode()
        )
        for i in range(length)
    ]


_chains = st.builds(_chain, st.integers(0, 2), st.integers(0, 6), st.integers(0, 3), st.integers(1, 8))


def _reference_match(ix: PrefixIndex, hashes: list[int]) -> dict[str, int]:
    """The reference's walk: +1 per block for every holder, stop at the first unheld block."""
    counts: dict[str, int] = {}
    for h in hashes:
        held = ix.holders(h)
        if not held:
            break
        for k in held:
            counts[k] = counts.get(k, 0) + 1
    return counts


@settings(max_examples=150, deadline=None)
@given(
    capacities=st.lists(st.integers(1, 12), min_size=4, max_size=4),
    ops=st.lists(st.tuples(st.integers(0, 3), _chains, st.booleans()), max_size=40),
    queries=st.lists(_chains, min_size=1, max_size=5),
)
def test_match_equals_the_reference_walk_under_evictions(
    capacities: list[int], ops: list[tuple[int, list[int], bool]], queries: list[list[int]]
) -> None:
    # holder sets along a chain stay nested under any mix of inserts, evictions and removals,
    # so the O(blocks + endpoints) match gives the reference's per-block count
    ix = PrefixIndex()
    for endpoint, chain, remove in ops:
        key = f"ns/e{endpoint}"
        if remove and endpoint == 3:
            ix.remove_endpoint(key)
        else:
            ix.add(chain, key, capacities[endpoint])
        assert ix.entries(key) <= capacities[endpoint]
    for q in queries:
        assert ix.match(q) == _reference_match(ix, q)
        for a, b in itertools.pairwise(q):
            assert ix.holders(b) <= ix.holders(a)
    assert ix.size() == sum(ix.entries(k) for k in ix.endpoint_keys())


def test_remove_endpoint_drops_its_entries() -> None:
    ix = PrefixIndex()
    ix.add([1, 2, 3], "A", 10)
    ix.add([1, 2], "B", 10)
    assert ix.remove_endpoint("A") == 3
    assert ix.size() == 2
    assert ix.holders(1) == {"B"}
    assert ix.holders(3) == frozenset()
    assert ix.endpoint_keys() == ["B"]
    assert ix.retain({"C"}) == ["B"]
    assert ix.size() == 0
    assert ix.hash_count() == 0


# --- the producer --------------------------------------------------------------------------------


async def test_produce_writes_match_info_for_every_candidate() -> None:
    eps = endpoints(4)
    prod = producer(**SMALL)
    prompt = "a" * 16 * 5 + "tail"  # 5 full blocks + partial = 6 blocks
    cycle = await route(prod, completion(prompt), eps, eps[2])
    assert infos(cycle, eps) == [(0, 6)] * 4  # cold: nothing matched yet, every candidate has an entry

    cycle = await route(prod, completion(prompt), eps, eps[2])
    assert infos(cycle, eps) == [(0, 6), (0, 6), (6, 6), (0, 6)]
    assert cycle[PREFIX_CACHE_MATCH_INFO_KEY][eps[2]].block_size_tokens == 4

    # same first 3 blocks, different rest: 3 of 7 blocks match on e2
    cycle = CycleState()
    await prod.produce(cycle, completion("a" * 48 + "b" * 60), eps)
    assert infos(cycle, eps)[2] == (3, 7)


async def test_short_prompt_scores_zero_everywhere() -> None:
    eps = endpoints(2)
    prod = producer(**SMALL)
    await route(prod, completion("hi"), eps, eps[0])
    cycle = CycleState()
    await prod.produce(cycle, completion("hi"), eps)
    assert infos(cycle, eps) == [(0, 0), (0, 0)]
    assert list(PrefixCacheScorer("p", PrefixCacheScorerParams()).score(cycle, completion("hi"), eps)) == [
        0.0,
        0.0,
    ]
    assert prod.index.size() == 0


async def test_pre_request_indexes_primary_and_prefill_targets() -> None:
    eps = endpoints(3)
    prod = producer(**SMALL)
    req = completion("p" * 64)
    cycle = CycleState()
    await prod.produce(cycle, req, eps)
    prod.pre_request(cycle, req, result(eps[0], prefill=eps[1]))
    cycle = CycleState()
    await prod.produce(cycle, req, eps)
    assert infos(cycle, eps) == [(4, 4), (4, 4), (0, 4)]


async def test_auto_tune_uses_first_candidate_block_size_and_endpoint_capacity() -> None:
    # 32-char blocks, 3-entry LRUs
    eps = endpoints(2, metrics=Metrics(cache_block_size=8, cache_num_blocks=3))
    prod = producer()  # autoTune defaults to true
    prompt = "q" * 32 * 5
    cycle = await route(prod, completion(prompt), eps, eps[0])
    assert infos(cycle, eps) == [(0, 5), (0, 5)]
    assert prod.index.capacity("default/e0") == 3
    assert prod.index.entries("default/e0") == 3


async def test_auto_tune_capacity_factor_scales_the_engines_capacity() -> None:
    eps = endpoints(2, metrics=Metrics(cache_block_size=8, cache_num_blocks=3))
    prod = producer(autoTuneCapacityFactor=2.0)
    cycle = await route(prod, completion("q" * 32 * 7), eps, eps[0])
    assert infos(cycle, eps) == [(0, 7), (0, 7)]
    assert prod.index.capacity("default/e0") == 6
    assert prod.index.entries("default/e0") == 6


@pytest.mark.parametrize("factor", [0.5, 1001.0])
def test_auto_tune_capacity_factor_out_of_range_names_the_field(factor: float) -> None:
    with pytest.raises(ConfigError, match="autoTuneCapacityFactor"):
        producer(autoTuneCapacityFactor=factor)


async def test_lru_capacity_per_server_is_honoured_without_auto_tune() -> None:
    # D5: the reference always uses 31250; here the parameter is the fixed capacity
    eps = endpoints(1, metrics=Metrics(cache_num_blocks=1000))
    prod = producer(autoTune=False, blockSizeTokens=4, lruCapacityPerServer=2)
    await route(prod, completion("w" * 16 * 6), eps, eps[0])
    assert prod.index.capacity("default/e0") == 2
    assert prod.index.entries("default/e0") == 2
    assert producer(autoTune=False, lruCapacityPerServer=0).params.lru_capacity == 31250


async def test_endpoints_that_left_the_pool_are_dropped() -> None:
    eps = endpoints(3)
    handle = StubHandle(endpoints=eps)
    prod = producer(handle, **SMALL)
    for e in eps:
        await route(prod, completion("s" * 64, rid=e.metadata.name), eps, e)
    assert sorted(prod.index.endpoint_keys()) == ["default/e0", "default/e1", "default/e2"]
    handle.eps = [eps[0], eps[2]]
    prod._next_sweep = 0.0  # the 2-minute check is due
    cycle = CycleState()
    await prod.produce(cycle, completion("s" * 64), [eps[0], eps[2]])
    assert sorted(prod.index.endpoint_keys()) == ["default/e0", "default/e2"]
    assert prod.index.size() == 8
    # an empty endpoint list means "unknown" (e.g. a handle not wired to the store), not "all gone"
    handle.eps = []
    prod._next_sweep = 0.0
    await prod.produce(CycleState(), completion("s" * 64), [eps[0]])
    assert prod.index.size() == 8
    assert prod.remove_endpoint("default/e0") == 4
    assert prod.index.endpoint_keys() == ["default/e2"]


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_metrics_hit_ratio_hit_bytes_and_size() -> None:
    gc.collect()  # indexes of earlier tests leave the size gauge
    eps = endpoints(2)
    prod = producer(**SMALL)
    size0 = _sample("inference_extension_prefix_indexer_size")
    count0 = _sample("inference_extension_prefix_indexer_hit_ratio_count")
    ratio0 = _sample("inference_extension_prefix_indexer_hit_ratio_sum")
    bytes0 = _sample("inference_extension_prefix_indexer_hit_bytes_sum")
    await route(prod, completion("m" * 64), eps, eps[0])  # cold: ratio 0
    await route(prod, completion("m" * 32 + "n" * 32), eps, eps[0])  # 2 of 4 blocks
    assert _sample("inference_extension_prefix_indexer_hit_ratio_count") - count0 == 2
    assert _sample("inference_extension_prefix_indexer_hit_ratio_sum") - ratio0 == pytest.approx(0.5)
    assert _sample("inference_extension_prefix_indexer_hit_bytes_sum") - bytes0 == 2 * 16
    assert _sample("inference_extension_prefix_indexer_size") - size0 == 6


# --- parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"autoTune": False, "blockSizeTokens": 0}, "blockSizeTokens"),
        ({"blockSizeTokens": -1}, "blockSizeTokens"),
        ({"maxPrefixTokensToMatch": -5}, "maxPrefixTokensToMatch"),
        ({"maxPrefixBlocksToMatch": -1}, "maxPrefixBlocksToMatch"),
        ({"blockSize": 64}, "blockSize"),  # deprecated, without blockSizeTokens
    ],
)
def test_invalid_producer_parameters(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_params(ApproxPrefixCacheParams, raw, "plugins[0].parameters")
    assert info.value.field == f"plugins[0].parameters.{field}"


def test_deprecated_block_size_is_ignored_next_to_block_size_tokens() -> None:
    p = decode_params(ApproxPrefixCacheParams, {"blockSize": 64, "blockSizeTokens": 32}, "p")
    assert p.block_size_tokens == 32


# --- the scorer ----------------------------------------------------------------------------------


def test_scorer_ratio_and_missing_or_invalid_entries() -> None:
    eps = endpoints(5)
    cycle = CycleState()
    cycle[PREFIX_CACHE_MATCH_INFO_KEY] = {
        eps[0]: PrefixCacheMatchInfo(3, 4, 16),
        eps[1]: PrefixCacheMatchInfo(0, 4, 16),
        eps[2]: PrefixCacheMatchInfo(2, 0, 16),  # total 0
        eps[3]: "not an info",
    }  # eps[4] missing
    scorer = PrefixCacheScorer("prefix-cache-scorer", PrefixCacheScorerParams())
    assert list(scorer.score(cycle, completion("x"), eps)) == [0.75, 0.0, 0.0, 0.0, 0.0]
    assert list(scorer.score(CycleState(), completion("x"), eps)) == [0.0] * 5
    assert PREFIX_CACHE_MATCH_INFO_KEY in PrefixCacheScorer.consumes


def test_scorer_parameters_describe_the_producer_d5() -> None:
    raw = {
        "blockSizeTokens": 32,
        "maxPrefixBlocksToMatch": 64,
        "lruCapacityPerServer": 500,
        "autoTune": False,
    }
    scorer = PrefixCacheScorer("prefix-cache-scorer", decode_params(PrefixCacheScorerParams, raw, "s"))
    assert scorer.producer_params() == decode_params(ApproxPrefixCacheParams, raw, "p")
    empty = PrefixCacheScorer("prefix-cache-scorer", decode_params(PrefixCacheScorerParams, {}, "s"))
    assert empty.producer_params() is None
    with pytest.raises(ConfigError) as info:  # validated with the producer's rules, on the scorer's key
        decode_params(
            PrefixCacheScorerParams, {"autoTune": False, "blockSizeTokens": 0}, "plugins[1].parameters"
        )
    assert info.value.field == "plugins[1].parameters.blockSizeTokens"


def test_loader_forwards_scorer_parameters_to_the_auto_created_producer() -> None:
    cfg = load_config(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: prefix-cache-scorer\n"
        "  parameters: {blockSizeTokens: 32, lruCapacityPerServer: 1000, autoTune: false}\n",
        environ={},
    )
    prod = cfg.plugins["approx-prefix-cache-producer"]
    assert isinstance(prod, ApproxPrefixCacheProducer)
    assert prod.params == ApproxPrefixCacheParams(
        auto_tune=False, block_size_tokens=32, lru_capacity_per_server=1000
    )
    assert prod in cfg.producers
    assert prod in cfg.pre_request


# --- prefix-cache-scorer: match length, producer name ---------------------------------------------


def test_scorer_match_length_term_favours_long_absolute_matches() -> None:
    eps = endpoints(3)
    infos = {
        eps[0]: PrefixCacheMatchInfo(2, 4, 16),  # ratio 0.5, 32 tokens
        eps[1]: PrefixCacheMatchInfo(500, 1000, 16),  # ratio 0.5, 8000 tokens
        eps[2]: PrefixCacheMatchInfo(0, 4, 16),
    }
    cycle = CycleState({PREFIX_CACHE_MATCH_INFO_KEY: infos})
    plain = PrefixCacheScorer("p", decode_params(PrefixCacheScorerParams, None, "p"))
    assert plain.score(cycle, completions(), eps) == [0.5, 0.5, 0.0]
    raw = {"matchLengthWeight": 0.5, "matchLengthScaleTokens": 16000}
    weighted = PrefixCacheScorer("p", decode_params(PrefixCacheScorerParams, raw, "p"))
    scores = weighted.score(cycle, completions(), eps)
    assert scores[0] == pytest.approx(0.5 * (32 / 16000) ** 2 + 0.25)
    assert scores[1] == pytest.approx(0.5 * 0.25 + 0.25)  # (8000 / 16000) ** 2 = 0.25
    assert scores[2] == 0.0
    capped = PrefixCacheScorer("p", decode_params(PrefixCacheScorerParams, {"matchLengthWeight": 1.0}, "p"))
    assert capped.score(cycle, completions(), eps)[1] == pytest.approx((8000 / 8192) ** 2)  # default scale


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"matchLengthWeight": 1.5}, "matchLengthWeight"),
        ({"matchLengthWeight": -0.1}, "matchLengthWeight"),
        ({"matchLengthWeight": 0.5, "matchLengthScaleTokens": 0}, "matchLengthScaleTokens"),
    ],
)
def test_scorer_match_length_bad_parameters(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_params(PrefixCacheScorerParams, raw, "plugins[0].parameters")
    assert info.value.field == f"plugins[0].parameters.{field}"


def test_scorer_producer_name_must_name_a_prefix_producer() -> None:
    producer = ApproxPrefixCacheProducer("mine", decode_params(ApproxPrefixCacheParams, None, "p"))
    params = decode_params(PrefixCacheScorerParams, {"prefixMatchInfoProducerName": "mine"}, "p")
    PrefixCacheScorer("s", params, StubHandle(producer))
    with pytest.raises(ConfigError) as info:
        PrefixCacheScorer("s", params, StubHandle())
    assert info.value.field == "prefixMatchInfoProducerName" and "not found" in info.value.reason
    other = PrefixCacheScorer("mine", decode_params(PrefixCacheScorerParams, None, "p"))
    with pytest.raises(ConfigError) as info:
        PrefixCacheScorer("s", params, StubHandle(other))
    assert "does not produce" in info.value.reason
    # the scorer's own parameters are not forwarded to the producer
    assert decode_params(PrefixCacheScorerParams, {"matchLengthWeight": 0.2}, "p").producer_params() is None


def test_no_hit_lru_checks_its_producer_name_too() -> None:
    from epp.plugins.scorers.no_hit_lru import NoHitLRUParams, NoHitLRUScorer

    params = decode_params(NoHitLRUParams, {"prefixMatchInfoProducerName": "mine"}, "p")
    producer = ApproxPrefixCacheProducer("mine", decode_params(ApproxPrefixCacheParams, None, "p"))
    NoHitLRUScorer("lru", params, StubHandle(producer))
    with pytest.raises(ConfigError) as info:
        NoHitLRUScorer("lru", params, StubHandle())
    assert info.value.field == "prefixMatchInfoProducerName"


@settings(max_examples=200, deadline=None)
@given(
    contents=st.lists(st.text(max_size=300), max_size=8),
    system=st.one_of(st.none(), st.text(max_size=60)),
    limit=st.integers(min_value=0, max_value=3000),
)
def test_prompt_prefix_is_the_start_of_the_whole_prompt(
    contents: list[str], system: str | None, limit: int
) -> None:
    """A long conversation's JSON is serialised only as far as hashing reads: same bytes."""
    messages = [{"role": "user", "content": c} for c in contents]
    for api, payload in (
        (ApiKind.CHAT_COMPLETIONS, {"messages": messages}),
        (ApiKind.MESSAGES, {"system": system, "tools": None, "messages": messages}),
    ):
        whole = RequestBody(api=api, payload=payload, raw=b"").prompt_bytes
        assert whole == RequestBody(api=api, payload=payload, raw=b"").prompt_text.encode()
        assert RequestBody(api=api, payload=payload, raw=b"").prompt_prefix(limit) == whole[:limit]


def test_a_long_prompt_chain_is_reused_and_equals_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turns of one conversation share their start: the cached chain is the chain of that start."""
    import epp.plugins.producers.approx_prefix_cache as module

    monkeypatch.setattr(module, "CHAIN_CACHE_SIZE", 2)
    prod = producer(**SMALL)  # 16-character blocks, at most 256 of them: 4096 characters read
    turn = "You are an agent. " * 300  # 5400 characters: the chain covers the first 4096
    calls = 0
    real = module.block_hashes

    def counting(*args: Any) -> list[int]:
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(module, "block_hashes", counting)
    first = prod.hashes(completion(turn), 4)
    again = prod.hashes(completion(turn + " and the next turn"), 4)
    assert first == again == expected_chain(turn.encode()[:4096], "m", "", 16)
    assert calls == 1  # the second turn's start was looked up
    other = prod.hashes(completion("Another conversation. " * 300), 4)
    assert other != first and calls == 2
    prod.hashes(completion("A third one. " * 400), 4)  # evicts the least recently used (the first)
    assert prod.hashes(completion(turn), 4) == first and calls == 4
    again[0] = 0  # a caller's list is its own
    assert prod.hashes(completion(turn), 4) == first


def _model_add(model: dict[str, list[int]], chain: list[int], key: str, capacity: int) -> None:
    """A plain per-endpoint LRU: the chain refreshed or inserted tail first, the oldest evicted."""
    lru = model.setdefault(key, [])
    for h in reversed(chain):
        if h in lru:
            lru.remove(h)
        lru.append(h)
        if len(lru) > capacity:
            lru.pop(0)


@settings(max_examples=150, deadline=None)
@given(
    capacities=st.lists(st.integers(1, 12), min_size=3, max_size=3),
    ops=st.lists(st.tuples(st.integers(0, 2), _chains), max_size=40),
)
def test_index_holds_what_a_plain_lru_per_endpoint_holds(
    capacities: list[int], ops: list[tuple[int, list[int]]]
) -> None:
    # also when a chain is added again to an endpoint that holds it all (the refresh-only path)
    ix = PrefixIndex()
    model: dict[str, list[int]] = {}
    for endpoint, chain in [*ops, *ops]:  # the second pass re-adds chains that may still be held
        key = f"ns/e{endpoint}"
        ix.add(chain, key, capacities[endpoint])
        _model_add(model, chain, key, capacities[endpoint])
    every = {h for _, chain in ops for h in chain}
    for h in every:
        assert ix.holders(h) == frozenset(k for k, lru in model.items() if h in lru)
