"""endpoint-health-filter: the `down` state from refused scrapes, never-scraped endpoints, the
passive outlier detector (exponential capped back-off), its default presence, the fail-over pick."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from epp.config.loader import load_config
from epp.datalayer.store import EndpointStore
from epp.framework import ConfigError, Endpoint, Metrics, MetricsState, UpstreamFailure
from epp.framework.params import decode_params
from epp.plugins.request_control.endpoint_health_filter import (
    EndpointHealthFilter,
    EndpointHealthFilterParams,
    OutlierDetector,
)
from tests.unit import factories
from tests.unit.factories import endpoint, known_metrics, metadata
from tests.unit.polling import until
from tests.unit.test_metrics_freshness import _scraper
from tests.unit.test_scraper import MetricsServer


def _ep(name: str, address: str, **values: Any) -> Endpoint:
    """An endpoint scraped successfully (at t=1.0 unless ``update_time`` says otherwise)."""
    values.setdefault("update_time", 1.0)
    return endpoint(name, address, metrics=known_metrics(**values))


def _filter(**params: Any) -> EndpointHealthFilter:
    return EndpointHealthFilter("h", decode_params(EndpointHealthFilterParams, params, "parameters"))


def _screen(f: EndpointHealthFilter, endpoints: list[Endpoint]) -> list[str]:
    return [e.metadata.name for e in f.screen(factories.request(), endpoints)]


# --- the down state ------------------------------------------------------------------------------


def test_a_refused_scrape_is_down_whatever_the_age_of_the_metrics() -> None:
    now = 100.0
    fresh_but_refused = Metrics(update_time=99.9, fresh_until=101.9, failure="connect")
    assert fresh_but_refused.state(now) is MetricsState.DOWN and fresh_but_refused.down
    # timeouts and garbage keep the freshness rule: recent values are still trusted
    assert Metrics(update_time=99.9, fresh_until=101.9, failure="timeout").state(now) is MetricsState.FRESH
    assert Metrics(failure="connect").state(now) is MetricsState.DOWN  # never up, refused


async def test_scraper_marks_a_refusing_endpoint_down_at_once_and_up_on_the_first_good_scrape() -> None:
    server = MetricsServer()
    await server.start()
    port = server.port
    store = EndpointStore()
    store.upsert(metadata("vllm-0", "127.0.0.1", port))
    scraper = _scraper(store, staleness=30.0)  # old metrics stay "fresh" for 30 s
    scraper.start()
    try:
        (e,) = store.endpoints()
        await until(lambda: e.metrics.update_time > 0)
        await server.stop()  # the engine dies: the port refuses
        t0 = time.monotonic()
        await until(lambda: e.metrics.down)
        assert time.monotonic() - t0 < 1.0  # one scrape interval (20 ms here), not the 30 s staleness
        assert e.metrics.state(time.monotonic()) is MetricsState.DOWN
        assert _screen(_filter(), [e, _ep("other", "10.0.0.2")]) == ["other"]
        server.port = port
        await server.start()  # restarted on the same port
        await until(lambda: not e.metrics.down)
        assert e.metrics.state(time.monotonic()) is MetricsState.FRESH
    finally:
        await scraper.stop()
        await server.stop()


# --- the screener --------------------------------------------------------------------------------


def test_healthy_pool_is_returned_as_is() -> None:
    endpoints = [_ep("a", "10.0.0.1"), _ep("b", "10.0.0.2")]
    assert _filter().screen(factories.request(), endpoints) is endpoints


def test_never_scraped_endpoints_get_nothing_while_others_have_metrics() -> None:
    never = endpoint("wrong-port", "10.0.0.9")  # update_time 0: never scraped successfully
    assert _screen(_filter(), [never, _ep("a", "10.0.0.1")]) == ["a"]
    # every endpoint without metrics (no data source, or at start-up): today's behaviour, all kept
    others = [endpoint("x", "10.0.0.7"), endpoint("y", "10.0.0.8")]
    assert _screen(_filter(), others) == ["x", "y"]
    assert _screen(_filter(excludeNeverScraped=False), [never, _ep("a", "10.0.0.1")]) == ["wrong-port", "a"]


def test_down_endpoints_are_excluded_but_never_all() -> None:
    down = _ep("down", "10.0.0.1", failure="connect")
    never = endpoint("never", "10.0.0.9")
    assert _screen(_filter(), [down, _ep("a", "10.0.0.2")]) == ["a"]
    assert _screen(_filter(), [down, never]) == ["never"]  # a never-scraped one beats a dead one
    assert _screen(_filter(), [down]) == ["down"]  # all down: kept (the engine's error is returned)
    assert _screen(_filter(excludeDown=False), [down, _ep("a", "10.0.0.2")]) == ["down", "a"]


# --- the outlier detector ------------------------------------------------------------------------


def _ejections(reason: str) -> float:
    return REGISTRY.get_sample_value("llm_d_epp_endpoint_ejections_total", {"reason": reason}) or 0.0


def test_connect_failure_ejects_with_doubling_capped_back_off() -> None:
    f = _filter(baseEjectionMs=1000, maxEjectionMs=3000)
    a, b = _ep("a", "10.0.0.1"), _ep("b", "10.0.0.2")
    before = _ejections("connect")
    now = time.monotonic()
    f.upstream_failed(a.hostport, UpstreamFailure.CONNECT, now)
    assert _ejections("connect") == before + 1
    det = f.detector
    assert det.is_ejected(a, now + 0.9) and not det.is_ejected(a, now + 1.01)  # 1 s, then back
    f.upstream_failed(a.hostport, UpstreamFailure.CONNECT, now + 1.1)
    assert det.is_ejected(a, now + 1.1 + 1.9) and not det.is_ejected(a, now + 1.1 + 2.01)  # 2 s
    f.upstream_failed(a.hostport, UpstreamFailure.RESET, now + 3.2)
    assert det.is_ejected(a, now + 3.2 + 2.9) and not det.is_ejected(a, now + 3.2 + 3.01)  # capped: 3 s
    f.upstream_failed(a.hostport, UpstreamFailure.CONNECT, now + 100)  # long healthy: back to base
    assert det.is_ejected(a, now + 100.9) and not det.is_ejected(a, now + 101.01)
    f.upstream_failed(b.hostport, UpstreamFailure.CONNECT, time.monotonic())
    assert _screen(f, [a, b]) == ["a"]


def test_server_errors_eject_after_a_run_within_the_window() -> None:
    det = OutlierDetector(EndpointHealthFilterParams(server_errors=3, failure_window_ms=1000))
    a = _ep("a", "10.0.0.1")
    now = 50.0
    assert not det.failed(a.hostport, UpstreamFailure.SERVER_ERROR, now)
    assert not det.failed(a.hostport, UpstreamFailure.SERVER_ERROR, now + 0.5)
    assert not det.failed(a.hostport, UpstreamFailure.SERVER_ERROR, now + 2.0)  # gap > window: restart
    assert not det.failed(a.hostport, UpstreamFailure.SERVER_ERROR, now + 2.5)
    assert det.failed(a.hostport, UpstreamFailure.SERVER_ERROR, now + 2.9)
    assert det.is_ejected(a, now + 3.0)
    # a good scrape does not end a 5xx ejection (the metrics port answering proves nothing)
    a.metrics = known_metrics(update_time=now + 3.0)
    assert det.is_ejected(a, now + 3.1)


def test_a_good_scrape_ends_a_connect_ejection() -> None:
    det = OutlierDetector(EndpointHealthFilterParams(base_ejection_ms=30_000))
    a = _ep("a", "10.0.0.1", update_time=10.0)
    assert det.failed(a.hostport, UpstreamFailure.CONNECT, 11.0)
    assert det.is_ejected(a, 12.0)
    a.metrics = known_metrics(update_time=12.5)  # the restarted engine answered a scrape
    assert not det.is_ejected(a, 13.0) and not det.ejected


def test_zero_threshold_never_ejects_and_params_are_validated() -> None:
    det = OutlierDetector(EndpointHealthFilterParams(connect_failures=0))
    assert not det.failed("10.0.0.1:8000", UpstreamFailure.CONNECT, 1.0)
    with pytest.raises(ConfigError, match="baseEjectionMs"):
        _filter(baseEjectionMs=5000, maxEjectionMs=1000)


# --- configuration -------------------------------------------------------------------------------


def test_every_configuration_gets_the_filter_once() -> None:
    assert [p.type_name for p in load_config(None).screeners] == ["endpoint-health-filter"]
    text = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- name: health
  type: endpoint-health-filter
  parameters: {connectFailures: 2}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
"""
    (screener,) = load_config(text).screeners
    assert isinstance(screener, EndpointHealthFilter) and screener.params.connect_failures == 2
