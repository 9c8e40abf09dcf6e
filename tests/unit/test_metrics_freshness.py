"""Unknown (never scraped, stale, failing) metrics: their state, the scraper's failure reasons, the
neutral score of the metric scorers, and the utilization detector's ``stalenessPolicy``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from epp.datalayer.freshness import FAILURE_REASONS, FreshnessCollector
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.framework import (
    ConfigError,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    MetricsState,
)
from epp.framework.attributes import INFLIGHT_LOAD_KEY, InFlightLoad
from epp.framework.params import decode_params
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.saturation.utilization_detector import UtilizationDetector, UtilizationDetectorParams
from epp.plugins.scorers._metric_scorer import NEUTRAL, neutral_score
from epp.plugins.scorers.active_request import ActiveRequestScorer
from epp.plugins.scorers.kv_cache_utilization import KVCacheUtilizationScorer
from epp.plugins.scorers.load_aware import LoadAwareParams, LoadAwareScorer
from epp.plugins.scorers.lora_affinity import LoraAffinityScorer
from epp.plugins.scorers.queue import QueueScorer
from epp.plugins.scorers.running_requests_size import RunningRequestsSizeScorer
from epp.plugins.scraping.core_metrics_extractor import CoreMetricsExtractor, CoreMetricsExtractorParams
from epp.plugins.scraping.metrics_data_source import MetricsDataSource, MetricsDataSourceParams
from epp.scheduling import SchedulerProfile, WeightedScorer
from tests.unit import factories
from tests.unit.factories import FRESH, endpoint, known_metrics, metadata
from tests.unit.polling import until
from tests.unit.test_scraper import MetricsServer


def ep(name: str, *, fresh_until: float = FRESH, update_time: float = 1.0, **values: Any) -> Endpoint:
    return endpoint(name, metrics=known_metrics(fresh_until=fresh_until, update_time=update_time, **values))


def never(name: str) -> Endpoint:
    """An endpoint that was never scraped: all zeros, which look idle."""
    return endpoint(name, "10.0.0.9")


def request() -> LLMRequest:
    return factories.request(request_id="r")


# --- state -------------------------------------------------------------------------------------


def test_metrics_state_never_fresh_stale_failed() -> None:
    now = 100.0
    assert Metrics().state(now) is MetricsState.NEVER
    assert not Metrics().known(now)
    assert Metrics(failure="timeout").state(now) is MetricsState.FAILED  # never succeeded, failing
    fresh = Metrics(update_time=99.0, fresh_until=101.0)
    assert fresh.state(now) is MetricsState.FRESH and fresh.known(now)
    # one failed attempt within the window does not distrust the last good values
    assert Metrics(update_time=99.0, fresh_until=101.0, failure="http_status").known(now)
    assert Metrics(update_time=90.0, fresh_until=92.0).state(now) is MetricsState.STALE
    assert Metrics(update_time=90.0, fresh_until=92.0, failure="no_metrics").state(now) is MetricsState.FAILED


# --- neutral scores ----------------------------------------------------------------------------


def test_neutral_score_is_the_mean_never_above_the_best() -> None:
    assert neutral_score([1.0, 0.5, 0.0]) == pytest.approx(0.5)
    assert neutral_score([0.1, 0.1, 0.1]) == 0.1  # exactly the common value: a tie, not a win
    assert neutral_score([2.0, -1.0]) == 0.5  # clamped like the profile clamps
    assert neutral_score([]) == NEUTRAL
    assert neutral_score([1.0, 1.0 - 1e-16, 1.0]) <= 1.0


def test_queue_scorer_normalises_over_known_endpoints_only() -> None:
    eps = [ep("a", waiting_queue_size=3), ep("b", waiting_queue_size=5), ep("c", waiting_queue_size=7)]
    unknown = never("u")
    scores = QueueScorer("q", None).score(CycleState(), request(), [*eps, unknown])
    # the known ones keep their full 1 .. 0 scale (the unknown zero does not stretch it); the
    # unknown endpoint ranks like an average one instead of the idlest
    assert list(scores) == pytest.approx([1.0, 0.5, 0.0, 0.5])


@pytest.mark.parametrize(
    ("scorer", "busy"),
    [
        (KVCacheUtilizationScorer("kv", None), {"kv_cache_usage_percent": 0.9}),
        (QueueScorer("q", None), {"waiting_queue_size": 9}),
        (RunningRequestsSizeScorer("r", None), {"running_requests_size": 30}),
        (LoadAwareScorer("l", LoadAwareParams(threshold=10)), {"waiting_queue_size": 9}),
        (LoraAffinityScorer("lora", None), {"active_models": {"x": 0}, "max_active_models": 1}),
    ],
    ids=["kv", "queue", "running", "load-aware", "lora"],
)
def test_unknown_metrics_tie_with_equally_busy_known_endpoints(scorer: QueueScorer, busy: dict) -> None:
    known = [ep(f"k{i}", **busy) for i in range(3)]
    stale = ep("stale", fresh_until=5.0, update_time=3.0)  # zeros from long ago
    scores = list(scorer.score(CycleState(), request(), [*known, never("u"), stale]))
    assert scores[3] == scores[0] and scores[4] == scores[0]  # never above the busy known ones


@pytest.mark.parametrize(
    "scorer",
    [QueueScorer("q", None), KVCacheUtilizationScorer("kv", None), LoraAffinityScorer("l", None)],
    ids=["queue", "kv", "lora"],
)
def test_no_known_metrics_every_candidate_scores_neutral(scorer: QueueScorer) -> None:
    eps = [never("a"), ep("b", fresh_until=0.5, waiting_queue_size=4), never("c")]
    assert list(scorer.score(CycleState(), request(), eps)) == [NEUTRAL] * 3


def test_expiry_is_read_per_cycle() -> None:
    e = ep("a", fresh_until=time.monotonic() + 0.05, kv_cache_usage_percent=0.9)
    other = ep("b", kv_cache_usage_percent=0.5)
    scorer = KVCacheUtilizationScorer("kv", None)
    assert list(scorer.score(CycleState(), request(), [e, other])) == pytest.approx([0.1, 0.5])
    time.sleep(0.06)
    assert list(scorer.score(CycleState(), request(), [e, other])) == pytest.approx([0.5, 0.5])


def _default_profile() -> SchedulerProfile:
    """The default profile's metric scorers (queue w2 + KV w2) and max-score picking."""
    return SchedulerProfile(
        "default",
        scorers=[
            WeightedScorer(QueueScorer("queue-scorer", None), 2.0),
            WeightedScorer(KVCacheUtilizationScorer("kv-cache-utilization-scorer", None), 2.0),
        ],
        picker=MaxScorePicker("max-score-picker", PickerParams()),
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.floats(0.0, 1.0)),
        min_size=1,
        max_size=6,
    )
)
def test_unknown_endpoint_never_beats_the_best_known_total(busy: list[tuple[int, float]]) -> None:
    known = [ep(f"k{i}", waiting_queue_size=q, kv_cache_usage_percent=kv) for i, (q, kv) in enumerate(busy)]
    unknown = never("u")
    profile = _default_profile()
    totals: dict[Endpoint, float] = {}
    for ws in profile.scorers:
        for e, s in zip(
            [*known, unknown], ws.scorer.score(CycleState(), request(), [*known, unknown]), strict=True
        ):
            totals[e] = totals.get(e, 0.0) + ws.weight * min(1.0, max(0.0, s))
    best_known = max(totals[e] for e in known)
    assert totals[unknown] <= best_known + 1e-12
    spread = best_known - min(totals[e] for e in known)
    if len({(q, kv) for q, kv in busy}) > 1 and spread > 1e-9:  # (not float noise)
        assert totals[unknown] < best_known  # strictly behind when the known ones differ


def _pick_counts(endpoints: Sequence[Endpoint], rounds: int) -> Counter[str]:
    profile = _default_profile()
    counts: Counter[str] = Counter()
    for _ in range(rounds):
        result = profile.run(CycleState(), request(), list(endpoints))
        counts[result.target_endpoints[0].metadata.name] += 1
    return counts


def test_unknown_endpoint_gets_at_most_a_fair_share_of_picks() -> None:
    # three busy scraped endpoints and one whose /metrics never answered (zeros)
    busy = [ep(f"k{i}", waiting_queue_size=2 + i, kv_cache_usage_percent=0.3 + 0.1 * i) for i in range(3)]
    assert _pick_counts([*busy, never("u")], 400)["u"] == 0  # behind the least busy one: never picked
    # all equally busy: the unknown endpoint ties and gets a fair share (1/4) of random tie-breaks
    equal = [ep(f"k{i}", waiting_queue_size=3, kv_cache_usage_percent=0.5) for i in range(3)]
    share = _pick_counts([*equal, never("u")], 4000)["u"] / 4000
    assert 0.25 - 0.05 < share < 0.25 + 0.05  # binomial sd 0.007: 7 sd either side


def test_inflight_counts_still_apply_to_unknown_endpoints() -> None:
    a, b = never("a"), never("b")
    cycle = CycleState()
    cycle[INFLIGHT_LOAD_KEY] = {
        a: InFlightLoad(requests=4, tokens=400),
        b: InFlightLoad(requests=1, tokens=100),
    }
    scores = list(ActiveRequestScorer("active", None).score(cycle, request(), [a, b]))
    assert scores[1] > scores[0]  # the EPP's own counts are known whatever the scrapes say


# --- scraper -----------------------------------------------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    srv = MetricsServer()
    await srv.start()
    yield srv
    await srv.stop()


def _scraper(store: EndpointStore, *, staleness: float = 2.0, timeout: float = 1.0) -> MetricsScraper:
    params = decode_params(MetricsDataSourceParams, {}, "source")
    source = MetricsDataSource("metrics-data-source", params)
    extractor = CoreMetricsExtractor("core-metrics-extractor", CoreMetricsExtractorParams())
    return MetricsScraper(store, source, extractor, interval=0.02, timeout=timeout, staleness=staleness)


def _failures(reason: str) -> float:
    value = REGISTRY.get_sample_value("llm_d_epp_datalayer_scrape_failures_total", {"reason": reason})
    return value or 0.0


def _endpoint(store: EndpointStore) -> Endpoint:
    (endpoint,) = store.endpoints()
    return endpoint


def test_every_failure_reason_is_exported_at_zero() -> None:
    for reason in FAILURE_REASONS:
        assert (
            REGISTRY.get_sample_value("llm_d_epp_datalayer_scrape_failures_total", {"reason": reason})
            is not None
        )


async def test_success_sets_fresh_until_then_the_metrics_go_stale(server: MetricsServer) -> None:
    store = EndpointStore()
    store.upsert(metadata("vllm-0", "127.0.0.1", server.port))
    scraper = _scraper(store, staleness=0.3)
    scraper.start()
    try:
        await until(lambda: _endpoint(store).metrics.update_time > 0)
        m = _endpoint(store).metrics
        assert m.fresh_until == pytest.approx(m.update_time + 0.3)
        assert m.state(time.monotonic()) is MetricsState.FRESH and m.failure == ""
        server.page = b"# nothing here\nthis is { not prometheus\n"  # garbage from now on
        failures = _failures("no_metrics")
        await until(lambda: _endpoint(store).metrics.failure == "no_metrics")
        assert _failures("no_metrics") > failures
        await until(lambda: not _endpoint(store).metrics.known(time.monotonic()))
        m = _endpoint(store).metrics
        assert m.state(time.monotonic()) is MetricsState.FAILED
        assert m.waiting_queue_size == 3  # the old values stay, they are just no longer trusted
    finally:
        await scraper.stop()


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("status", "http_status"), ("hang", "timeout"), ("garbage", "no_metrics")],
)
async def test_failure_reasons_recorded_and_cleared_on_recovery(
    server: MetricsServer, fault: str, reason: str
) -> None:
    good_page = server.page
    if fault == "status":
        server.status = 500
    elif fault == "hang":
        server.delay = 1.5  # beyond the 0.2 s poll timeout
    else:
        server.page = bytes(range(256)) * 8
    store = EndpointStore()
    store.upsert(metadata("vllm-0", "127.0.0.1", server.port))
    scraper = _scraper(store, timeout=0.2)
    before = _failures(reason)
    scraper.start()
    try:
        await until(lambda: _endpoint(store).metrics.failure == reason)
        assert _failures(reason) > before
        m = _endpoint(store).metrics
        assert m.state(time.monotonic()) is MetricsState.FAILED and m.update_time == 0.0
        server.status, server.delay, server.page = 200, 0.0, good_page
        await until(lambda: _endpoint(store).metrics.known(time.monotonic()))
        assert _endpoint(store).metrics.failure == ""
    finally:
        await scraper.stop()


def test_staleness_must_be_positive() -> None:
    with pytest.raises(ValueError, match="staleness"):
        _scraper(EndpointStore(), staleness=0.0)


class _FakeScraper:
    def __init__(self, endpoints: list[Endpoint], staleness: float) -> None:
        self.endpoints = endpoints
        self.staleness = staleness

    def tracked_endpoints(self) -> Sequence[Endpoint]:
        return self.endpoints


def test_collector_counts_endpoints_by_state() -> None:
    now = time.monotonic()
    collector = FreshnessCollector()
    shared = ep("fresh", fresh_until=now + 10)
    scraper = _FakeScraper(
        [
            shared,
            never("new"),
            ep("stale", update_time=now - 5, fresh_until=now - 3),
            ep("down", update_time=now - 5, fresh_until=now - 3, failure="timeout"),
            ep("refused", update_time=now, fresh_until=now + 2, failure="connect"),
        ],
        staleness=2.0,
    )
    other = _FakeScraper([shared], staleness=0.5)  # an endpoint seen twice counts once
    collector.track(scraper)
    collector.track(other)
    assert collector.counts(now) == {
        MetricsState.NEVER: 1,
        MetricsState.FRESH: 1,
        MetricsState.STALE: 1,
        MetricsState.FAILED: 1,
        MetricsState.DOWN: 1,
    }
    families = {f.name: f for f in collector.collect()}
    samples = {s.labels["state"]: s.value for s in families["llm_d_epp_datalayer_endpoints"].samples}
    assert samples == {"never": 1, "fresh": 1, "stale": 1, "failed": 1, "down": 1}
    (threshold,) = families["llm_d_epp_datalayer_metrics_staleness_threshold_seconds"].samples
    assert threshold.value == 2.0


# --- utilization detector: stalenessPolicy -----------------------------------------------------


def _detector(policy: str) -> UtilizationDetector:
    return UtilizationDetector(
        "gate",
        decode_params(
            UtilizationDetectorParams,
            {"queueDepthThreshold": 4, "kvCacheUtilThreshold": 0.8, "stalenessPolicy": policy},
            "p",
        ),
    )


def _stale_gauge() -> float | None:
    return REGISTRY.get_sample_value("llm_d_epp_flow_control_stale_endpoints", {"detector": "gate"})


def test_staleness_policy_saturated_counts_stale_as_full() -> None:
    now = time.monotonic()
    d = _detector("saturated")
    mixed = [ep("a", update_time=now, waiting_queue_size=2), never("b")]
    assert d.saturation(mixed) == pytest.approx((0.5 + 1.0) / 2)
    assert _stale_gauge() == 1
    assert d.saturation([never("a"), never("b")]) == 1.0
    assert _stale_gauge() == 2


def test_staleness_policy_ignore_leaves_stale_endpoints_out() -> None:
    now = time.monotonic()
    d = _detector("ignore")
    mixed = [ep("a", update_time=now, waiting_queue_size=2), never("b")]
    assert d.saturation(mixed) == pytest.approx(0.5)
    assert _stale_gauge() == 1
    assert d.saturation([never("a"), never("b")]) == 0.0  # all stale: dispatch continues
    assert _stale_gauge() == 2
    assert d.saturation([]) == 1.0  # no endpoints is still saturated
    # the filter is the same under both policies: stale endpoints are dropped (fail open)
    fresh = ep("f", update_time=now)
    assert d.filter(CycleState(), request(), [fresh, never("b")]) == [fresh]


def test_staleness_policy_is_validated() -> None:
    with pytest.raises(ConfigError, match='stalenessPolicy must be "credit", "saturated" or "ignore"'):
        _detector("optimistic")
