"""``utilization-detector``: parameters, saturation, the fail-open filter, and its place in the config."""

from __future__ import annotations

import dataclasses
import time

import pytest

from epp.config import ConfigError, load_config
from epp.framework import CycleState, Endpoint, Metrics, SaturationDetector
from epp.framework.durations import parse_go_duration
from epp.plugins.saturation.utilization_detector import UtilizationDetector, UtilizationDetectorParams
from tests.unit.factories import CONFIG_HEADER as HEADER
from tests.unit.factories import NO_ENV, endpoint


def ep(i: int, queue: int = 0, kv: float = 0.0, age: float | None = 0.0) -> Endpoint:
    """An endpoint whose metrics were scraped ``age`` seconds ago (None: never scraped)."""
    updated = 0.0 if age is None else time.monotonic() - age
    metrics = Metrics(waiting_queue_size=queue, kv_cache_usage_percent=kv, update_time=updated)
    return endpoint(f"ep-{i}", f"10.0.0.{i}", metrics=metrics)


def S(
    i: int, queue: int = 0, kv: float = 0.0, age: float | None = 0.0
) -> tuple[int, int, float, float | None]:
    """An endpoint spec; built into an ``Endpoint`` inside the test, so ages count from the test."""
    return (i, queue, kv, age)


def build(specs: list[tuple[int, int, float, float | None]]) -> list[Endpoint]:
    return [ep(*spec) for spec in specs]


def detector(**params: object) -> UtilizationDetector:
    return UtilizationDetector("utilization-detector", UtilizationDetectorParams(**params))  # type: ignore[arg-type]


# --- parameters --------------------------------------------------------------------------------


def test_defaults() -> None:
    p = UtilizationDetectorParams()
    assert (
        p.queue_depth_threshold,
        p.kv_cache_util_threshold,
        p.metrics_staleness_threshold,
        p.headroom,
    ) == (
        5,
        0.8,
        "200ms",
        0.0,
    )
    assert p.staleness_seconds == pytest.approx(0.2)
    d = UtilizationDetector("d")
    assert isinstance(d, SaturationDetector)
    assert d.typed_name == "d/utilization-detector"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("200ms", 0.2),
        ("1.5s", 1.5),
        ("1m30s", 90.0),
        ("2h", 7200.0),
        ("100us", 1e-4),
        ("100µs", 1e-4),
        (".5s", 0.5),
        ("0", 0.0),
        ("-2s", -2.0),
    ],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "200", "ms", "2 s", "2sec", "1s2", "abc"])
def test_invalid_go_durations(text: str) -> None:
    assert parse_go_duration(text) is None


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        (
            "{queueDepthThreshold: 0}",
            "queueDepthThreshold",
            "queueDepthThreshold must be strictly positive, got 0",
        ),
        (
            "{kvCacheUtilThreshold: 1.5}",
            "kvCacheUtilThreshold",
            "kvCacheUtilThreshold must be in (0, 1], got 1.5",
        ),
        (
            "{kvCacheUtilThreshold: 0}",
            "kvCacheUtilThreshold",
            "kvCacheUtilThreshold must be in (0, 1], got 0",
        ),
        (
            "{metricsStalenessThreshold: 0s}",
            "metricsStalenessThreshold",
            "metricsStalenessThreshold must be strictly positive, got 0s",
        ),
        ("{metricsStalenessThreshold: soon}", "metricsStalenessThreshold", "must be a duration"),
        ("{metricsStalenessThreshold: 200}", "metricsStalenessThreshold", "expected a string"),
        ("{headroom: -0.5}", "headroom", "headroom must be non-negative, got -0.5"),
        ("{queueDepthThreshold: invalid}", "queueDepthThreshold", "expected an integer"),
        ("{queueThreshold: 3}", "queueThreshold", "unknown parameter"),
    ],
)
def test_invalid_parameters_name_the_field(params: str, field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            f"{HEADER}plugins:\n- {{type: utilization-detector, parameters: {params}}}\n", environ=NO_ENV
        )
    assert info.value.field == f"plugins[0].parameters.{field}"
    assert reason in info.value.reason


def test_several_invalid_parameters_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            f"{HEADER}plugins:\n- type: utilization-detector\n"
            "  parameters: {queueDepthThreshold: 0, kvCacheUtilThreshold: 2}\n",
            environ=NO_ENV,
        )
    assert info.value.field == "plugins[0].parameters.queueDepthThreshold"
    assert (
        "invalid utilization detector configuration: queueDepthThreshold must be strictly positive, got 0"
        in (info.value.reason)
    )
    assert "kvCacheUtilThreshold must be in (0, 1], got 2" in info.value.reason


def test_high_headroom_is_accepted_with_a_warning() -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        detector(headroom=2.0)
    assert any(e["log_level"] == "warning" and e["headroom"] == 2.0 for e in logs)


# --- saturation (reference cases: queue 5, KV 0.9, staleness 100ms) --------------------------------


REF = {
    "queue_depth_threshold": 5,
    "kv_cache_util_threshold": 0.9,
    "metrics_staleness_threshold": "100ms",
    "staleness_policy": "saturated",
}


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [
        ([], 1.0),  # fail closed
        ([S(1, 2, 0.5)], 0.5 / 0.9),
        ([S(1, 1, 0.1, age=0.2)], 1.0),  # stale
        ([S(1, 1, 0.1, age=None)], 1.0),  # never scraped
        ([S(1, 10, 0.1)], 2.0),  # not capped
        ([S(1, 1, 0.95)], 0.95 / 0.9),
        ([S(1, 1, 0.1), S(2, 0, 0.2)], (0.2 + 0.2 / 0.9) / 2),
        ([S(1, 1, 0.1), S(2, 0, 0.2, age=0.3)], 0.6),
        ([S(1, 1, 0.1), S(2, 15, 0.2)], 1.6),
        ([S(1, 1, 0.1, age=0.2), S(2, 20, 0.2), S(3, 1, 0.99)], (1.0 + 4.0 + 1.1) / 3),
        ([S(1, 5, 0.1)], 1.0),  # queue exactly at the threshold
        ([S(1, 1, 0.1, age=0.101)], 1.0),  # just over the staleness threshold
    ],
)
def test_saturation(endpoints: list[tuple[int, int, float, float | None]], expected: float) -> None:
    assert detector(**REF).saturation(build(endpoints)) == pytest.approx(expected, abs=1e-4)


def test_default_thresholds() -> None:
    d = UtilizationDetector("d", UtilizationDetectorParams(staleness_policy="saturated"))
    assert d.saturation([ep(1, 4, 0.4)]) == pytest.approx(0.8)  # max(4/5, 0.4/0.8)
    assert d.saturation([ep(1, 0, 0.0, age=0.1)]) == 0.0  # 100 ms is fresh under 200 ms
    assert d.saturation([ep(1, 0, 0.0, age=0.25)]) == 1.0


# --- in-flight credit (the default stalenessPolicy) ---------------------------------------------


def credited(queue: int, kv: float, at_scrape: int, inflight: int, age: float | None = 0.0) -> Endpoint:
    """An endpoint scraped with ``at_scrape`` requests of this EPP in flight, now ``inflight``."""
    e = ep(1, queue, kv, age)
    e.metrics = Metrics(
        waiting_queue_size=queue,
        kv_cache_usage_percent=kv,
        update_time=e.metrics.update_time,
        inflight_at_scrape=at_scrape,
    )
    e.inflight = inflight
    return e


def test_credit_counts_requests_sent_since_the_scrape_as_queued() -> None:
    d = UtilizationDetector("d")  # queue threshold 5, KV 0.8, 200 ms, credit
    assert d.params.staleness_policy == "credit"
    assert d.saturation([credited(1, 0.0, at_scrape=2, inflight=2)]) == pytest.approx(0.2)
    assert d.saturation([credited(1, 0.0, at_scrape=2, inflight=6)]) == pytest.approx(1.0)  # 1 + 4 sent
    # two finished since the scrape: two of the queued ones run now
    assert d.saturation([credited(3, 0.0, at_scrape=4, inflight=2)]) == pytest.approx(0.2)
    assert d.saturation([credited(1, 0.0, at_scrape=4, inflight=0)]) == 0.0  # never below empty
    assert d.saturation([credited(0, 0.6, at_scrape=0, inflight=1)]) == pytest.approx(0.75)  # KV wins


def test_credit_keeps_stale_endpoints_dispatchable() -> None:
    d = UtilizationDetector("d")
    stale = credited(0, 0.1, at_scrape=3, inflight=4, age=15.0)  # 15 s old: last snapshot + 1 sent
    assert d.saturation([stale]) == pytest.approx(0.2)
    never = credited(0, 0.0, at_scrape=0, inflight=3, age=None)  # never scraped: all of it queued
    assert d.saturation([never]) == pytest.approx(0.6)
    assert d.saturation([credited(0, 0.0, at_scrape=0, inflight=0, age=None)]) == 0.0
    strict = UtilizationDetector("s", UtilizationDetectorParams(staleness_policy="saturated"))
    assert strict.saturation([stale]) == 1.0


def test_pending_requests_count_as_queued_across_the_pool() -> None:
    d = UtilizationDetector("d")
    pool = [credited(0, 0.0, 0, 0), credited(0, 0.0, 0, 0)]
    assert d.dispatch_saturation(pool, 0) == 0.0
    assert d.dispatch_saturation(pool, 5) == pytest.approx(0.5)  # 5 queued over 2 x threshold 5


# --- filter (queue 5, KV 0.8, staleness 100ms, headroom 0.2: limits 6 and 0.96) -----------------


FILTER = {**REF, "kv_cache_util_threshold": 0.8, "headroom": 0.2}


@pytest.mark.parametrize(
    ("endpoints", "kept"),
    [
        ([S(1, 1, 0.1), S(2, 4, 0.7)], [1, 2]),
        ([S(1, 5, 0.8)], [1]),  # at the threshold, inside the burst
        ([S(1, 5, 0.9)], [1]),
        ([S(1, 7, 0.1), S(2, 1, 0.1)], [2]),
        ([S(1, 6, 0.1), S(2, 1, 0.1)], [2]),  # the limit itself is excluded
        ([S(1, 1, 0.97), S(2, 1, 0.5)], [2]),
        ([S(1, 1, 0.1, age=0.2), S(2, 1, 0.1)], [2]),  # stale dropped
        ([S(1, 1, 0.1, age=0.2), S(2, 1, 0.1, age=None)], [1, 2]),  # all stale: fail open
        ([S(1, 10, 0.1), S(2, 1, 0.99)], [1, 2]),  # all saturated: fail open
        ([], []),
    ],
)
def test_filter(endpoints: list[tuple[int, int, float, float | None]], kept: list[int]) -> None:
    out = detector(**FILTER).filter(CycleState(), None, build(endpoints))  # type: ignore[arg-type]
    assert [int(e.metadata.name.split("-")[1]) for e in out] == kept


# --- configuration -----------------------------------------------------------------------------


def test_default_config_uses_it_for_admission_only() -> None:
    cfg = load_config(None, environ=NO_ENV)
    assert isinstance(cfg.saturation_detector, UtilizationDetector)
    assert all(not p.filters for p in cfg.scheduler.profiles.values())


def test_declared_instance_is_used_without_a_saturation_detector_section() -> None:
    cfg = load_config(
        f"{HEADER}plugins:\n- {{type: utilization-detector, parameters: {{queueDepthThreshold: 9}}}}\n"
        "- {type: queue-scorer}\n"
        "schedulingProfiles:\n- {name: default, plugins: [{pluginRef: queue-scorer}]}\n",
        environ=NO_ENV,
    )
    assert cfg.saturation_detector is cfg.plugins["utilization-detector"]
    assert cfg.saturation_detector.params.queue_depth_threshold == 9
    assert [f.name for f in cfg.scheduler.profiles["default"].filters] == []


def test_a_renamed_instance_can_be_referenced() -> None:
    cfg = load_config(
        f"{HEADER}plugins:\n- {{name: gate, type: utilization-detector, parameters: {{headroom: 0.5}}}}\n"
        "saturationDetector: {pluginRef: gate}\n",
        environ=NO_ENV,
    )
    assert cfg.saturation_detector is cfg.plugins["gate"]
    assert "utilization-detector" not in cfg.plugins


def test_declaring_only_the_detector_keeps_the_default_scheduling() -> None:
    """Unlike the reference, a detector declared to tune admission does not become a filter."""
    cfg = load_config(
        f"{HEADER}plugins:\n- {{type: utilization-detector, parameters: {{kvCacheUtilThreshold: 1.0}}}}\n",
        environ=NO_ENV,
    )
    default = cfg.scheduler.profiles["default"]
    assert default.filters == []
    assert [s.scorer.name for s in default.scorers] == ["prefix-spread-scorer"]
    assert cfg.saturation_detector is cfg.plugins["utilization-detector"]


def test_implicit_profile_leaves_the_detector_out() -> None:
    cfg = load_config(
        f"{HEADER}plugins:\n- {{type: utilization-detector}}\n- {{type: queue-scorer}}\n", environ=NO_ENV
    )
    default = cfg.scheduler.profiles["default"]
    assert default.filters == []
    assert [s.scorer.name for s in default.scorers] == ["queue-scorer"]


def test_referenced_in_a_profile_it_is_also_a_filter() -> None:
    cfg = load_config(
        f"{HEADER}plugins:\n- {{type: utilization-detector}}\n- {{type: queue-scorer}}\n"
        "schedulingProfiles:\n- name: default\n"
        "  plugins: [{pluginRef: utilization-detector}, {pluginRef: queue-scorer}]\n",
        environ=NO_ENV,
    )
    assert [f.name for f in cfg.scheduler.profiles["default"].filters] == ["utilization-detector"]
    assert cfg.saturation_detector is cfg.plugins["utilization-detector"]


def test_requests_sent_since_the_scrape_fill_the_slots_it_showed_free_first() -> None:
    d = UtilizationDetector("d")  # queue threshold 5
    e = credited(0, 0.0, at_scrape=2, inflight=6)  # 4 sent since a scrape that showed 2 running
    e.metrics = dataclasses.replace(e.metrics, running_requests_size=2, peak_running=5)
    assert d.saturation([e]) == pytest.approx(1 / 5)  # 3 slots were free: 1 of the 4 queues
    e.metrics = dataclasses.replace(e.metrics, peak_running=2)  # never seen running more
    assert d.saturation([e]) == pytest.approx(4 / 5)
