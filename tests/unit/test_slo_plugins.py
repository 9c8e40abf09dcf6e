"""``latency-scorer``, ``slo-headroom-tier-filter`` and ``latency-slo-admitter`` on given predictions."""

from __future__ import annotations

import random

import pytest

from epp.framework import CycleState, Endpoint, ErrorCode
from epp.framework.attributes import (
    LATENCY_PREDICTION_INFO_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from epp.framework.wire import REQUEST_DROPPED_REASON_HEADER
from epp.plugins.filters.slo_headroom_tier import SloHeadroomTierFilter, SloHeadroomTierParams
from epp.plugins.request_control.latency_slo_admitter import LatencySloAdmitter
from epp.plugins.scorers.latency import LatencyScorer, LatencyScorerParams
from tests.unit.factories import completions, config_error, endpoint, known_metrics

BUSY = known_metrics(running_requests_size=3, kv_cache_usage_percent=0.5)


def info(ttft_headroom: float, tpot_headroom: float = 0.0, *, dispatched: int = 1) -> LatencyPredictionInfo:
    return LatencyPredictionInfo(
        ttft_valid=ttft_headroom > 0,
        tpot_valid=tpot_headroom >= 0,
        ttft_headroom=ttft_headroom,
        tpot_headroom=tpot_headroom,
        ttft=100.0,
        tpot=10.0,
        dispatched_request_count=dispatched,
    )


def eps(n: int) -> list[Endpoint]:
    return [endpoint(f"e{i}", f"10.0.0.{i}", metrics=BUSY) for i in range(n)]


def cycle_with(infos: dict[Endpoint, LatencyPredictionInfo]) -> CycleState:
    cycle = CycleState()
    cycle[LATENCY_PREDICTION_INFO_KEY] = infos
    return cycle


def order(scores: list[float] | tuple[float, ...], endpoints: list[Endpoint]) -> list[str]:
    """Endpoint names from best to worst score."""
    ranked = sorted(zip(scores, endpoints, strict=True), key=lambda se: -se[0])
    return [e.metadata.name for _, e in ranked]


# --- scorer -------------------------------------------------------------------------------------


def test_least_bin_packs_closest_to_the_slo_and_most_keeps_the_margin() -> None:
    e = eps(3)
    cycle = cycle_with({e[0]: info(300.0), e[1]: info(20.0), e[2]: info(150.0)})
    least = LatencyScorer("s", LatencyScorerParams())
    most = LatencyScorer("s", LatencyScorerParams(headroom_selection_strategy="most"))
    req = completions()
    least_scores = list(least.score(cycle, req, e))
    assert order(least_scores, e) == ["e1", "e2", "e0"]
    assert order(list(most.score(cycle, req, e)), e) == ["e0", "e2", "e1"]
    assert least_scores[1] == pytest.approx(1.01) and least_scores[0] == pytest.approx(0.01)


def test_mixed_tiers_score_only_the_positive_endpoints() -> None:
    e = eps(3)
    cycle = cycle_with({e[0]: info(-50.0), e[1]: info(40.0), e[2]: info(10.0, -1.0)})
    scores = LatencyScorer("s", LatencyScorerParams()).score(cycle, completions(), e)
    assert scores[0] == 0.0 and scores[2] == 0.0 and scores[1] > 0.0


def test_all_negative_prefers_idle_then_the_least_severe_deficit() -> None:
    e = eps(3)
    s = LatencyScorer("s", LatencyScorerParams(headroom_selection_strategy="most"))
    idle = cycle_with({e[0]: info(-10.0), e[1]: info(-500.0, dispatched=0), e[2]: info(-20.0)})
    scores = s.score(idle, completions(), e)
    assert scores[1] > 0.0 and scores[0] == 0.0 and scores[2] == 0.0

    # TPOT-only deficit beats TTFT-only beats both, however large
    buckets = cycle_with({e[0]: info(-1.0, -1.0), e[1]: info(-5.0, 3.0), e[2]: info(4.0, -900.0)})
    scores = s.score(buckets, completions(), e)
    assert scores[2] > 0.0 and scores[0] == 0.0 and scores[1] == 0.0

    # within a bucket the least deficit wins even with "most"
    both = cycle_with({e[0]: info(-10.0, -1.0), e[1]: info(-300.0, -1.0), e[2]: info(-100.0, -1.0)})
    assert order(list(s.score(both, completions(), e)), e) == ["e0", "e2", "e1"]


def test_a_dimension_without_range_gives_its_weight_to_the_other() -> None:
    e = eps(2)
    # equal TTFT headroom: TPOT alone decides, despite ttftWeight 0.8
    cycle = cycle_with({e[0]: info(100.0, 5.0), e[1]: info(100.0, 1.0)})
    scores = LatencyScorer("s", LatencyScorerParams()).score(cycle, completions(), e)
    assert scores[1] == pytest.approx(1.01) and scores[0] == pytest.approx(0.01)


def test_composite_fallback_without_predictions() -> None:
    e = [
        endpoint("a", metrics=known_metrics(waiting_queue_size=0, kv_cache_usage_percent=0.2)),
        endpoint("b", "10.0.0.2", metrics=known_metrics(waiting_queue_size=4, kv_cache_usage_percent=0.6)),
    ]
    cycle = CycleState()
    cycle[PREFIX_CACHE_MATCH_INFO_KEY] = {e[1]: PrefixCacheMatchInfo(10, 10, 16)}
    scores = LatencyScorer("s", LatencyScorerParams()).score(cycle, completions(), e)
    # a: (0.8 + 1 + 0) / 3; b: (0.4 + 0 + 1) / 3, on a 1/100 grid
    assert scores == [pytest.approx(0.6), pytest.approx(0.47)]
    only_kv = LatencyScorer("s", LatencyScorerParams(composite_queue_weight=0, composite_prefix_weight=0))
    assert only_kv.score(cycle, completions(), e) == [pytest.approx(0.8), pytest.approx(0.4)]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("headroomSelectionStrategy: max", "headroomSelectionStrategy"),
        ("ttftWeight: -1", "ttftWeight"),
        ("compositeKVWeight: -0.5", "compositeKVWeight"),
        ("latencyPredictionInfoProducerName: nobody", "latencyPredictionInfoProducerName"),
    ],
)
def test_scorer_parameters_are_validated(params: str, field: str) -> None:
    err = config_error(
        f"""
plugins:
- type: latency-scorer
  parameters: {{{params}}}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: latency-scorer
"""
    )
    assert field in str(err)


# --- tier filter --------------------------------------------------------------------------------


class FixedRandom(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


def test_tier_filter_keeps_the_positive_tier_and_sometimes_explores() -> None:
    e = eps(4)
    cycle = cycle_with({e[0]: info(10.0), e[1]: info(-10.0), e[2]: info(5.0, -1.0)})  # e3: no prediction
    keep = SloHeadroomTierFilter("f", SloHeadroomTierParams(), rng=FixedRandom(0.5))
    assert keep.filter(cycle, completions(), e) == [e[0]]
    explore = SloHeadroomTierFilter("f", SloHeadroomTierParams(), rng=FixedRandom(0.005))
    assert explore.filter(cycle, completions(), e) == [e[1], e[2], e[3]]


def test_tier_filter_exploration_rate_follows_epsilon() -> None:
    e = eps(2)
    cycle = cycle_with({e[0]: info(10.0), e[1]: info(-10.0)})
    f = SloHeadroomTierFilter("f", SloHeadroomTierParams(epsilon_explore_neg=0.2), rng=random.Random(42))
    explored = sum(f.filter(cycle, completions(), e) == [e[1]] for _ in range(5000))
    assert 800 < explored < 1200  # 1000 expected; 6 standard deviations either side


def test_tier_filter_falls_back_to_one_tier_or_everything() -> None:
    e = eps(3)
    f = SloHeadroomTierFilter("f", SloHeadroomTierParams(epsilon_explore_neg=1.0))
    negative = cycle_with({e[0]: info(-1.0), e[1]: info(-2.0)})
    assert f.filter(negative, completions(), e) == e  # only a negative tier (with e2, unpredicted)
    positive = cycle_with({e[0]: info(1.0), e[1]: info(2.0), e[2]: info(0.0)})
    assert f.filter(positive, completions(), e) == e
    assert f.filter(CycleState(), completions(), e) == e  # no predictions at all
    assert f.filter(cycle_with({}), completions(), e) == e


def test_tier_filter_epsilon_is_validated() -> None:
    err = config_error(
        """
plugins:
- type: slo-headroom-tier-filter
  parameters: {epsilonExploreNeg: 1.5}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: max-score-picker
"""
    )
    assert "epsilonExploreNeg" in str(err)


# --- admitter -----------------------------------------------------------------------------------


def test_admitter_rejects_a_sheddable_request_no_warm_busy_endpoint_can_serve_in_slo() -> None:
    a = LatencySloAdmitter("a")
    e = eps(2)
    cycle = cycle_with({e[0]: info(-10.0), e[1]: info(-5.0)})
    r = completions()
    r.priority, r.slo_ttft_ms = -1, 200.0
    err = a.admit(cycle, r, e)
    assert err is not None and err.code is ErrorCode.RESOURCE_EXHAUSTED
    assert err.headers[REQUEST_DROPPED_REASON_HEADER] == "rejected-saturated"
    assert "no valid endpoint" in err.message


def test_admitter_admits_when_some_endpoint_is_valid_idle_or_cold() -> None:
    a = LatencySloAdmitter("a")
    r = completions()
    r.priority, r.slo_tpot_ms = -1, 20.0
    e = eps(2)
    assert a.admit(cycle_with({e[0]: info(-10.0), e[1]: info(5.0, 1.0)}), r, e) is None  # e1 valid
    idle = [
        e[0],
        endpoint("idle", metrics=known_metrics(running_requests_size=0, kv_cache_usage_percent=0.5)),
    ]
    assert a.admit(cycle_with({idle[0]: info(-1.0), idle[1]: info(-1.0)}), r, idle) is None
    cold = [
        e[0],
        endpoint("cold", metrics=known_metrics(running_requests_size=2, kv_cache_usage_percent=0.01)),
    ]
    assert a.admit(cycle_with({cold[0]: info(-1.0), cold[1]: info(-1.0)}), r, cold) is None


def test_admitter_never_rejects_critical_requests_without_slo_or_without_predictions() -> None:
    a = LatencySloAdmitter("a")
    e = eps(2)
    hopeless = cycle_with({e[0]: info(-10.0), e[1]: info(-5.0)})
    critical = completions()
    critical.slo_ttft_ms = 100.0
    assert a.admit(hopeless, critical, e) is None  # priority 0
    no_slo = completions()
    no_slo.priority = -1
    assert a.admit(hopeless, no_slo, e) is None
    r = completions()
    r.priority, r.slo_ttft_ms = -1, 100.0
    assert a.admit(CycleState(), r, e) is None
