"""prefill-cost-scorer: hits weighed against queued prefill, bounded load, hashed tie-breaks."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.framework import ConfigError, CycleState, Endpoint, LLMRequest, ProfileRunResult, SchedulingResult
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.params import decode_params
from epp.framework.registry import lookup
from epp.plugins.scorers.prefill_cost import PrefillCostParams, PrefillCostScorer
from tests.unit.factories import endpoints, request


def _scorer(**params: object) -> PrefillCostScorer:
    return PrefillCostScorer("pc", decode_params(PrefillCostParams, params, "parameters"))


def _req(tokens: int, prompt: str = "p", request_id: str = "r") -> LLMRequest:
    return request({"model": "m", "prompt": prompt}, size=tokens * 4, request_id=request_id)


def _cycle(infos: dict[Endpoint, PrefixCacheMatchInfo] | None = None) -> CycleState:
    cycle = CycleState()
    if infos is not None:
        cycle[PREFIX_CACHE_MATCH_INFO_KEY] = infos
    return cycle


def _dispatch(s: PrefillCostScorer, req: LLMRequest, cycle: CycleState, eps: list[Endpoint]) -> Endpoint:
    """Score, pick the best (first on ties), run PreRequest; the picked endpoint."""
    scores = list(s.score(cycle, req, eps))
    best = eps[max(range(len(eps)), key=lambda i: (scores[i], -i))]
    s.pre_request(cycle, req, SchedulingResult({"default": ProfileRunResult([best])}, "default"))
    return best


def test_registered_with_its_inputs() -> None:
    assert lookup("prefill-cost-scorer") is PrefillCostScorer
    assert PREFIX_CACHE_MATCH_INFO_KEY in PrefillCostScorer.consumes


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"missPenalty": -1}, "missPenalty"),
        ({"requestCostTokens": -1}, "requestCostTokens"),
        ({"floorTokens": 0}, "floorTokens"),
        ({"loadBound": 0.5}, "loadBound"),
        ({"loadBoundMin": 0}, "loadBoundMin"),
        ({"hashPrefixChars": -1}, "hashPrefixChars"),
    ],
)
def test_bad_parameters_name_the_field(params: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _scorer(**params)


def test_a_hit_wins_over_an_idle_miss() -> None:
    a, b = endpoints(2)
    s = _scorer(hashPrefixChars=0)
    infos = {a: PrefixCacheMatchInfo(60, 64, 16), b: PrefixCacheMatchInfo(0, 64, 16)}
    scores = s.score(_cycle(infos), _req(1024), [a, b])
    assert scores[0] == 1.0 and scores[1] < 0.3


def test_a_hit_loses_to_a_miss_when_its_queue_is_longer_than_the_prefill_it_saves() -> None:
    a, b = endpoints(2)
    s = _scorer(hashPrefixChars=0, loadBound=0)
    queued = [_req(4000, request_id=f"q{i}") for i in range(3)]  # three cold prompts queued on a
    for req in queued:
        s.pre_request(_cycle(), req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
    assert s.queue(a.metadata.key) == (3, 12000)
    infos = {a: PrefixCacheMatchInfo(60, 64, 16), b: PrefixCacheMatchInfo(0, 64, 16)}
    scores = s.score(_cycle(infos), _req(1024), [a, b])
    assert scores[1] == 1.0 and scores[0] < scores[1]


def test_finished_requests_release_their_charge() -> None:
    a, b = endpoints(2)
    s = _scorer()
    req = _req(2000)
    cycle = _cycle()
    s.score(cycle, req, [a, b])
    s.pre_request(cycle, req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
    assert s.queue(a.metadata.key) == (1, 2000)
    s.request_done(req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
    assert s.queue(a.metadata.key) == (0, 0)
    s.request_done(req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))  # once only
    assert s.queue(a.metadata.key) == (0, 0)


def test_the_charge_is_the_uncached_part_on_the_picked_endpoint() -> None:
    a, b = endpoints(2)
    s = _scorer()
    cycle = _cycle({a: PrefixCacheMatchInfo(48, 64, 16), b: PrefixCacheMatchInfo(0, 64, 16)})
    req = _req(1024)
    s.score(cycle, req, [a, b])
    s.pre_request(cycle, req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
    assert s.queue(a.metadata.key) == (1, 256)


def test_the_same_cold_prefix_prefers_the_same_endpoint_and_others_spread() -> None:
    eps = endpoints(8)
    s = _scorer()
    firsts = []
    for g in range(64):
        scores = list(s.score(_cycle(), _req(100, prompt=f"system prompt {g} " * 40), eps))
        again = list(s.score(_cycle(), _req(100, prompt=f"system prompt {g} " * 40 + "more"), eps))
        top = max(range(8), key=scores.__getitem__)
        assert top == max(range(8), key=again.__getitem__)  # same first characters, same choice
        firsts.append(top)
    assert len(set(firsts)) == 8  # different prefixes go everywhere


def test_a_cold_burst_of_one_prefix_does_not_pile_up() -> None:
    eps = endpoints(4)
    s = _scorer()
    counts: Counter[str] = Counter()
    holder = ""
    in_flight: list[LLMRequest] = []  # all 48 stay in flight (a dropped request releases its charge)
    for i in range(48):
        # after the first dispatch the approximate index says its endpoint holds the prefix
        infos = {e: PrefixCacheMatchInfo(60 if e.metadata.key == holder else 0, 64, 16) for e in eps}
        in_flight.append(_req(1024, prompt="shared system prompt", request_id=f"b{i}"))
        picked = _dispatch(s, in_flight[-1], _cycle(infos), eps)
        holder = holder or picked.metadata.key
        counts[picked.metadata.key] += 1
    assert len(counts) == 4
    assert max(counts.values()) <= 1.5 * min(counts.values())


def test_load_bound_zero_turns_the_bound_off() -> None:
    a, b = endpoints(2)
    infos = {a: PrefixCacheMatchInfo(64, 64, 16), b: PrefixCacheMatchInfo(0, 64, 16)}
    queued = [_req(0, request_id=f"q{i}") for i in range(10)]  # ten tiny requests in flight on a
    for params, a_score in (({"loadBound": 0}, "positive"), ({}, "zero")):
        s = _scorer(hashPrefixChars=0, **params)
        for req in queued:
            s.pre_request(_cycle(), req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
        score = s.score(_cycle(infos), _req(1024), [a, b])[0]
        assert (score > 0.0) if a_score == "positive" else (score == 0.0)
