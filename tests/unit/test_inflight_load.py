"""``inflight-load-producer`` counters and the scorers reading them (active-request, token-load)."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import pytest

from epp.framework import (
    ConfigError,
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    ResponseInfo,
    SchedulingResult,
)
from epp.framework.attributes import (
    INFLIGHT_LOAD_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from epp.framework.params import decode_params
from epp.plugins.producers.inflight_load import (
    InFlightLoadParams,
    InFlightLoadProducer,
    estimate_output_tokens,
    estimate_tokens,
)
from epp.plugins.scorers.active_request import ActiveRequestParams, ActiveRequestScorer
from epp.plugins.scorers.token_load import TokenLoadParams, TokenLoadScorer
from tests.unit.factories import StubHandle, completions, endpoint, endpoints

WITH_OUTPUT = InFlightLoadParams(add_estimated_output_tokens=True)  # input + round(1.5 * input)


def with_output() -> InFlightLoadProducer:
    return InFlightLoadProducer("inflight-load-producer", WITH_OUTPUT)


def request(size: int = 400, prompt: str = "", rid: str = "r") -> LLMRequest:
    return completions(prompt, size=size, request_id=rid)


def result(
    decode: Endpoint, prefill: Endpoint | None = None, encode: Endpoint | None = None
) -> SchedulingResult:
    results: dict[str, ProfileRunResult | None] = {"decode": ProfileRunResult([decode])}
    if prefill is not None:
        results["prefill"] = ProfileRunResult([prefill])
    if encode is not None:
        results["encode"] = ProfileRunResult([encode])
    return SchedulingResult(results, "decode")


async def loads(prod: InFlightLoadProducer, eps: list[Endpoint]) -> list[tuple[int, int]]:
    """(requests, tokens) per endpoint as produced for a new request."""
    cycle = CycleState()
    await prod.produce(cycle, request(), eps)
    m = cycle[INFLIGHT_LOAD_KEY]
    assert set(m) == set(eps)
    return [(m[e].requests, m[e].tokens) for e in eps]


# --- token estimate ------------------------------------------------------------------------------


def test_token_estimate() -> None:
    assert estimate_tokens(request(size=400)) == 100 + 150
    assert estimate_tokens(request(size=403)) == 100 + 150  # integer division of the size
    # size unknown: round(10 / 4) = 3 (half away from zero, not Python's half-to-even 2); 3 + round(4.5)
    assert estimate_tokens(request(size=0, prompt="x" * 10)) == 3 + 5
    assert estimate_tokens(request(size=0, prompt="")) == 0


# --- counters ------------------------------------------------------------------------------------


async def test_pre_request_charges_every_profile_and_request_done_releases() -> None:
    eps = endpoints(4)
    prod = with_output()
    assert await loads(prod, eps) == [(0, 0)] * 4
    r1, r2 = request(400, rid="1"), request(800, rid="2")
    prod.pre_request(CycleState(), r1, result(eps[0], prefill=eps[1], encode=eps[2]))
    prod.pre_request(CycleState(), r2, result(eps[0]))
    assert await loads(prod, eps) == [(2, 250 + 500), (1, 250), (1, 250), (0, 0)]
    prod.request_done(r1, result(eps[0], prefill=eps[1], encode=eps[2]))
    assert await loads(prod, eps) == [(1, 500), (0, 0), (0, 0), (0, 0)]
    prod.request_done(r2, result(eps[0]))
    assert await loads(prod, eps) == [(0, 0)] * 4


async def test_prefill_released_at_response_headers_and_only_once() -> None:
    eps = endpoints(2)
    prod = with_output()
    r = request(400)
    res = result(eps[0], prefill=eps[1])
    prod.pre_request(CycleState(), r, res)
    prod.response_header(r, ResponseInfo(status=200), eps[0])
    assert await loads(prod, eps) == [(1, 250), (0, 0)]
    prod.response_header(r, ResponseInfo(status=200), eps[0])  # a second call changes nothing
    assert await loads(prod, eps) == [(1, 250), (0, 0)]
    prod.request_done(r, res)
    assert await loads(prod, eps) == [(0, 0), (0, 0)]


async def test_request_without_response_releases_everything_at_done() -> None:
    eps = endpoints(2)
    prod = with_output()
    r = request(400)
    res = result(eps[0], prefill=eps[1])
    prod.pre_request(CycleState(), r, res)
    prod.request_done(r, res)  # client disconnected before any response header
    assert await loads(prod, eps) == [(0, 0), (0, 0)]


async def test_counters_never_go_negative() -> None:
    eps = endpoints(1)
    prod = with_output()
    r = request(400)
    prod.request_done(r, result(eps[0]))  # never charged
    prod.pre_request(CycleState(), r, result(eps[0]))
    prod.request_done(r, result(eps[0]))
    prod.request_done(r, result(eps[0]))  # called twice
    prod.response_header(r, ResponseInfo(), eps[0])
    assert await loads(prod, eps) == [(0, 0)]
    other = request(400, rid="other")  # charges live as long as their request object
    prod.pre_request(CycleState(), other, result(eps[0]))
    assert await loads(prod, eps) == [(1, 250)]  # the double release did not eat into a new request


async def test_failed_profiles_are_not_charged() -> None:
    eps = endpoints(2)
    prod = with_output()
    r = request(400)
    res = SchedulingResult({"decode": ProfileRunResult([eps[0]]), "prefill": None}, "decode")
    prod.pre_request(CycleState(), r, res)
    assert await loads(prod, eps) == [(1, 250), (0, 0)]


async def test_dropped_request_releases_its_charges() -> None:
    eps = endpoints(1)
    prod = with_output()
    r: LLMRequest | None = request(400)
    assert r is not None
    prod.pre_request(CycleState(), r, result(eps[0]))
    assert await loads(prod, eps) == [(1, 250)]
    r = None  # e.g. a later PreRequest plugin raised and the server never saw the routing
    gc.collect()
    assert await loads(prod, eps) == [(0, 0)]


async def test_removed_endpoint_counters_are_dropped_without_negative_releases() -> None:
    eps = endpoints(2)
    handle = StubHandle(endpoints=eps)
    prod = InFlightLoadProducer("inflight-load-producer", WITH_OUTPUT, handle)
    old = request(400, rid="old")
    prod.pre_request(CycleState(), old, result(eps[1]))
    assert prod.snapshot() == {"default/e1": InFlightLoad(tokens=250, requests=1)}

    handle.eps = [eps[0]]  # e1 left the pool
    prod._next_sweep = 0.0  # the periodic check is due
    await prod.produce(CycleState(), request(), [eps[0]])
    assert prod.snapshot() == {}

    back = endpoint("e1", "10.0.0.1")  # same key, new endpoint object
    handle.eps = [eps[0], back]
    new = request(800, rid="new")
    prod.pre_request(CycleState(), new, result(back))
    prod.request_done(old, result(eps[1]))  # the old request ends late: must not touch the new counter
    assert prod.load("default/e1") == InFlightLoad(tokens=500, requests=1)
    prod.request_done(new, result(back))
    assert prod.load("default/e1") == InFlightLoad(tokens=0, requests=0)


async def test_default_charges_input_only_and_gives_tokens_back_at_the_first_response() -> None:
    eps = endpoints(2)
    prod = InFlightLoadProducer("inflight-load-producer")  # addEstimatedOutputTokens: false
    r = request(400)
    res = result(eps[0], prefill=eps[1])
    prod.pre_request(CycleState(), r, res)
    assert await loads(prod, eps) == [(1, 100), (1, 100)]
    prod.response_header(r, ResponseInfo(status=200), eps[0])  # prefill done: tokens back, request stays
    assert await loads(prod, eps) == [(1, 0), (0, 0)]
    prod.request_done(r, res)
    assert await loads(prod, eps) == [(0, 0), (0, 0)]


async def test_estimated_output_is_held_until_the_end() -> None:
    eps = endpoints(1)
    prod = with_output()
    r = request(400)
    prod.pre_request(CycleState(), r, result(eps[0]))
    prod.response_header(r, ResponseInfo(status=200), eps[0])
    assert await loads(prod, eps) == [(1, 250)]


def test_output_estimate_is_capped_by_the_client_and_the_operator() -> None:
    assert estimate_output_tokens(completions("p"), 100) == 150
    assert estimate_output_tokens(completions("p", max_tokens=20), 100) == 20
    assert estimate_output_tokens(completions("p", max_completion_tokens=30), 100) == 30
    assert estimate_output_tokens(completions("p", max_tokens=500), 100, 0.5) == 50
    assert estimate_output_tokens(completions("p", max_tokens=20), 100, 1.5, cap=10) == 10
    assert estimate_output_tokens(completions("p"), 100, 1.5, cap=0) == 0
    assert estimate_output_tokens(completions("p"), 0) == 0
    prod = InFlightLoadProducer(
        "p",
        decode_params(
            InFlightLoadParams,
            {"addEstimatedOutputTokens": True, "outputRatio": 0.5, "maxEstimatedOutputTokens": 40},
            "p",
        ),
    )
    eps = endpoints(1)
    r = request(400)  # charges live as long as their request object
    prod.pre_request(CycleState(), r, result(eps[0]))  # 100 input + min(50, 40)
    assert prod.load(eps[0].metadata.key) == InFlightLoad(tokens=140, requests=1)


async def test_cached_prefix_is_not_charged() -> None:
    eps = endpoints(2)
    prod = InFlightLoadProducer("inflight-load-producer")
    cycle = CycleState()
    # 6 blocks of 16 tokens indexed (96 of the 100 input tokens), 4 of them cached on e0
    cycle[PREFIX_CACHE_MATCH_INFO_KEY] = {
        eps[0]: PrefixCacheMatchInfo(4, 6, 16),
        eps[1]: PrefixCacheMatchInfo(0, 6, 16),
    }
    r = request(400)
    prod.pre_request(cycle, r, result(eps[0], prefill=eps[1]))
    assert prod.load(eps[0].metadata.key).tokens == 2 * 16 + 4  # uncached blocks + unindexed tail
    assert prod.load(eps[1].metadata.key).tokens == 100


def test_inflight_parameters() -> None:
    p = decode_params(InFlightLoadParams, {}, "p")
    assert (p.add_estimated_output_tokens, p.output_ratio, p.max_estimated_output_tokens) == (
        False,
        1.5,  # the ratio used (an explicit null means the same)
        None,
    )
    for key, bad in (("outputRatio", -0.1), ("maxEstimatedOutputTokens", -1)):
        with pytest.raises(ConfigError) as e:
            decode_params(InFlightLoadParams, {key: bad}, "p")
        assert e.value.field == f"p.{key}" and "non-negative" in e.value.reason


# --- scorers -------------------------------------------------------------------------------------


def cycle_with(eps: list[Endpoint], loads_: Sequence[tuple[int, int] | None]) -> CycleState:
    cycle = CycleState()
    cycle[INFLIGHT_LOAD_KEY] = {
        e: InFlightLoad(tokens=x[1], requests=x[0]) for e, x in zip(eps, loads_, strict=True) if x is not None
    }
    return cycle


def test_active_request_scores() -> None:
    eps = endpoints(4)
    cycle = cycle_with(eps, [(0, 0), (1, 10), (3, 10), None])
    default = ActiveRequestScorer("a", decode_params(ActiveRequestParams, {}, "p"))
    assert list(default.score(cycle, request(), eps)) == pytest.approx([1.0, 2 / 3, 0.0, 1.0])
    tuned = ActiveRequestScorer("a", ActiveRequestParams(idle_threshold=1, max_busy_score=0.5))
    assert list(tuned.score(cycle, request(), eps)) == pytest.approx([1.0, 1.0, 0.0, 1.0])
    cycle = cycle_with(eps, [(0, 0), (2, 0), (4, 0), (1, 0)])
    assert list(tuned.score(cycle, request(), eps)) == pytest.approx([1.0, 0.25, 0.0, 1.0])
    assert list(default.score(CycleState(), request(), eps)) == [1.0] * 4
    assert INFLIGHT_LOAD_KEY in ActiveRequestScorer.consumes


def test_active_request_parameters() -> None:
    # D10: an omitted maxBusyScore is the documented 1.0 (the reference decodes it to 0)
    assert decode_params(ActiveRequestParams, {}, "p").max_busy_score == 1.0
    p = decode_params(ActiveRequestParams, {"requestTimeout": "2m", "idleThreshold": -3}, "p")
    assert ActiveRequestScorer("a", p)._idle == 0
    with pytest.raises(ConfigError) as info:
        decode_params(ActiveRequestParams, {"maxBusyScore": 1.5}, "p")
    assert info.value.field == "p.maxBusyScore"


def test_token_load_scores() -> None:
    eps = endpoints(4)
    cycle = cycle_with(eps, [(0, 0), (1, 250), (3, 1500), None])
    scorer = TokenLoadScorer("t", TokenLoadParams(queue_threshold_tokens=1000))
    assert list(scorer.score(cycle, request(), eps)) == pytest.approx([1.0, 0.75, 0.0, 1.0])
    default = TokenLoadScorer("t", decode_params(TokenLoadParams, {"queueThresholdTokens": 0}, "p"))
    cycle = cycle_with(eps, [(1, 4194304 // 4), None, None, None])
    assert list(default.score(cycle, request(), eps)) == pytest.approx([0.75, 1.0, 1.0, 1.0])
    assert INFLIGHT_LOAD_KEY in TokenLoadScorer.consumes


async def test_producer_feeds_scorers_end_to_end() -> None:
    eps = endpoints(3)
    prod = with_output()
    live = [request(400, rid="a0"), request(400, rid="a1"), request(4000, rid="b")]
    for r, target in zip(live, [eps[0], eps[0], eps[1]], strict=True):
        prod.pre_request(CycleState(), r, result(target))
    cycle = CycleState()
    await prod.produce(cycle, request(), eps)
    active = ActiveRequestScorer("a", ActiveRequestParams())
    assert list(active.score(cycle, request(), eps)) == pytest.approx([0.0, 0.5, 1.0])
    tokens = TokenLoadScorer("t", TokenLoadParams(queue_threshold_tokens=5000))
    assert list(tokens.score(cycle, request(), eps)) == pytest.approx([1 - 500 / 5000, 1 - 2500 / 5000, 1.0])
