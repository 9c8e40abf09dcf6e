"""prefix-spread-scorer: prefix affinity under a bounded load, cold prompts spread, prompt heads kept."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.framework import ConfigError, CycleState, Endpoint, LLMRequest, ProfileRunResult, SchedulingResult
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.params import decode_params
from epp.framework.registry import lookup
from epp.plugins.scorers.prefix_spread import PrefixSpreadParams, PrefixSpreadScorer
from tests.unit.factories import endpoints, known_metrics, request


def _scorer(**params: object) -> PrefixSpreadScorer:
    return PrefixSpreadScorer("ps", decode_params(PrefixSpreadParams, params, "parameters"))


def _req(prompt: str = "p", request_id: str = "r") -> LLMRequest:
    return request({"model": "m", "prompt": prompt}, size=len(prompt), request_id=request_id)


def _cycle(infos: dict[Endpoint, PrefixCacheMatchInfo] | None = None) -> CycleState:
    cycle = CycleState()
    if infos is not None:
        cycle[PREFIX_CACHE_MATCH_INFO_KEY] = infos
    return cycle


def _dispatch(s: PrefixSpreadScorer, req: LLMRequest, cycle: CycleState, eps: list[Endpoint]) -> Endpoint:
    """Score, pick the best (first on ties), run PreRequest; the picked endpoint."""
    scores = list(s.score(cycle, req, eps))
    best = eps[max(range(len(eps)), key=lambda i: (scores[i], -i))]
    s.pre_request(cycle, req, SchedulingResult({"default": ProfileRunResult([best])}, "default"))
    return best


def _done(s: PrefixSpreadScorer, req: LLMRequest) -> None:
    s.request_done(req, SchedulingResult({}, "default"))


def test_registered_with_its_inputs() -> None:
    assert lookup("prefix-spread-scorer") is PrefixSpreadScorer
    assert PREFIX_CACHE_MATCH_INFO_KEY in PrefixSpreadScorer.consumes


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"loadBound": 0.5}, "loadBound"),
        ({"loadBoundMin": 0}, "loadBoundMin"),
        ({"balanceWeight": -1}, "balanceWeight"),
        ({"coldMatchRatio": 2}, "coldMatchRatio"),
        ({"newPromptWeight": -1}, "newPromptWeight"),
        ({"newPromptHalfLife": 0}, "newPromptHalfLife"),
        ({"hashPrefixChars": -1}, "hashPrefixChars"),
    ],
)
def test_bad_parameters_name_the_field(params: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _scorer(**params)


def test_a_hit_wins_over_idle_misses_while_under_the_bound() -> None:
    a, b, c = endpoints(3)
    s = _scorer()
    queued = [_req(request_id=f"q{i}") for i in range(5)]  # five in flight on a: under the bound (8)
    for req in queued:
        s.pre_request(_cycle(), req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
    assert s.in_flight(a.metadata.key) == 5
    infos = {a: PrefixCacheMatchInfo(60, 64, 16), b: PrefixCacheMatchInfo(0, 64, 16)}
    scores = s.score(_cycle(infos), _req(), [a, b, c])
    assert scores[0] > scores[1] and scores[0] > scores[2]


def test_an_endpoint_at_the_bound_scores_zero_and_its_prefix_spills() -> None:
    a, b, c = endpoints(3)
    s = _scorer(loadBoundMin=2)
    queued = [_req(request_id=f"q{i}") for i in range(4)]  # kept: a collected request releases its count
    for req in queued:
        s.pre_request(_cycle(), req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
    assert s.in_flight(a.metadata.key) == 4
    infos = {a: PrefixCacheMatchInfo(64, 64, 16)}
    scores = s.score(_cycle(infos), _req(), [a, b, c])
    assert scores[0] == 0.0 and scores[1] > 0.0 and scores[2] > 0.0


def test_load_bound_zero_turns_the_bound_off() -> None:
    a, b = endpoints(2)
    s = _scorer(loadBound=0)
    queued = [_req(request_id=f"q{i}") for i in range(20)]
    for req in queued:
        s.pre_request(_cycle(), req, SchedulingResult({"d": ProfileRunResult([a])}, "d"))
    assert s.in_flight(a.metadata.key) == 20
    scores = s.score(_cycle({a: PrefixCacheMatchInfo(64, 64, 16)}), _req(), [a, b])
    assert scores[0] > scores[1]


def test_finished_requests_release_their_count_once() -> None:
    a, b = endpoints(2)
    s = _scorer()
    req = _req()
    _dispatch(s, req, _cycle(), [a, b])
    picked = a if s.in_flight(a.metadata.key) else b
    assert s.in_flight(picked.metadata.key) == 1
    _done(s, req)
    _done(s, req)
    assert s.in_flight(a.metadata.key) == 0 and s.in_flight(b.metadata.key) == 0


def test_the_engines_scraped_load_counts_when_it_is_higher() -> None:
    busy = known_metrics(running_requests_size=4, waiting_queue_size=6)
    a, b = endpoints(2)
    a.metrics = busy
    s = _scorer()
    assert s.load(a, 0.0) == 10 and s.load(b, 0.0) == 0
    scores = s.score(_cycle(), _req(), [a, b])
    assert scores[1] > scores[0]


def test_a_cold_burst_keeps_each_prefix_whole_and_spreads_the_prefixes() -> None:
    """48 requests of 8 prefixes all in flight at once over 4 endpoints (the bench's cold burst):
    every prefix's first request goes where the fewest new prompts and requests are, the rest follow
    the prefix index (simulated: it says the prefix's endpoint holds it)."""
    eps = endpoints(4)
    s = _scorer()
    sizes = {0: 6, 1: 5, 2: 5, 3: 6, 4: 10, 5: 5, 6: 8, 7: 3}
    order = [g for g in range(8) for _ in range(sizes[g])]
    order = order[::2] + order[1::2]  # interleaved
    holders: dict[int, set[str]] = {}
    counts: Counter[str] = Counter()
    in_flight = []
    for i, g in enumerate(order):
        held = holders.get(g, set())
        infos = {e: PrefixCacheMatchInfo(60 if e.metadata.key in held else 0, 64, 16) for e in eps}
        in_flight.append(_req(prompt=f"system prompt {g} " * 40, request_id=f"b{i}"))
        picked = _dispatch(s, in_flight[-1], _cycle(infos), eps)
        holders.setdefault(g, set()).add(picked.metadata.key)
        counts[picked.metadata.key] += 1
    assert len(counts) == 4
    assert max(counts.values()) <= 1.5 * min(counts.values()), counts
    assert sum(len(h) for h in holders.values()) <= 9, holders  # at most one prefix split


def test_new_prompts_spread_even_when_nothing_is_in_flight() -> None:
    """Conversations that start one after another, each finishing before the next: the count of new
    prompts each endpoint took (not the momentary load) spreads them evenly."""
    eps = endpoints(4)
    s = _scorer()
    counts: Counter[str] = Counter()
    for i in range(12):
        req = _req(prompt=f"conversation {i} system prompt " * 30, request_id=f"c{i}")
        counts[_dispatch(s, req, _cycle(), eps).metadata.key] += 1
        _done(s, req)
    assert sorted(counts.values()) == [3, 3, 3, 3]


def test_a_forgotten_prompt_goes_back_to_where_its_head_went() -> None:
    eps = endpoints(4)
    s = _scorer()
    first = _req(prompt="a long conversation's system prompt " * 30, request_id="t0")
    home = _dispatch(s, first, _cycle(), eps)
    _done(s, first)
    for i in range(6):  # other conversations start (and spread), then the index forgets this one
        other = _req(prompt=f"another conversation {i} " * 40, request_id=f"o{i}")
        _dispatch(s, other, _cycle(), eps)
        _done(s, other)
    nxt = _req(prompt="a long conversation's system prompt " * 30 + "turn 2", request_id="t1")
    assert _dispatch(s, nxt, _cycle(), eps) is home


def test_the_same_cold_prefix_picks_the_same_endpoint_on_every_replica() -> None:
    eps = endpoints(8)
    firsts = []
    for g in range(32):
        prompt = f"system prompt {g} " * 40
        picks = {_dispatch(_scorer(), _req(prompt=prompt), _cycle(), eps).metadata.key for _ in range(3)}
        assert len(picks) == 1  # fresh scorers (replicas) agree
        firsts.append(picks.pop())
    assert len(set(firsts)) >= 6  # different prefixes go to different endpoints
