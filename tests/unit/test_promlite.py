"""The hot-path metric primitives render the same exposition as prometheus-client."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from epp import promlite


def test_counter_gauge_histogram_exposition() -> None:
    registry = CollectorRegistry()
    c = promlite.Counter("demo_requests_total", "Requests.", ["model"])
    g = promlite.Gauge("demo_running", "Running.", ["model"])
    h = promlite.Histogram("demo_seconds", "Latency.", ["model"], buckets=(0.1, 1.0, 10.0))
    promlite.register(c, g, h, registry=registry)
    c.labels("m").inc()
    c.labels("m").inc(2)
    g.labels("m").inc()
    g.labels("m").inc()
    g.labels("m").dec()
    for v in (0.05, 0.1, 0.5, 20.0):
        h.labels("m").observe(v)
    assert registry.get_sample_value("demo_requests_total", {"model": "m"}) == 3.0
    assert registry.get_sample_value("demo_running", {"model": "m"}) == 1.0
    # le is inclusive: 0.05 and 0.1 fall in the 0.1 bucket; buckets are cumulative
    assert registry.get_sample_value("demo_seconds_bucket", {"model": "m", "le": "0.1"}) == 2.0
    assert registry.get_sample_value("demo_seconds_bucket", {"model": "m", "le": "1.0"}) == 3.0
    assert registry.get_sample_value("demo_seconds_bucket", {"model": "m", "le": "10.0"}) == 3.0
    assert registry.get_sample_value("demo_seconds_bucket", {"model": "m", "le": "+Inf"}) == 4.0
    assert registry.get_sample_value("demo_seconds_count", {"model": "m"}) == 4.0
    assert registry.get_sample_value("demo_seconds_sum", {"model": "m"}) == 20.65
    text = generate_latest(registry).decode()
    assert "# TYPE demo_requests_total counter" in text
    assert "# TYPE demo_seconds histogram" in text


def test_labels_are_checked_and_children_cached() -> None:
    c = promlite.Counter("demo_x_total", "X.", ["a", "b"])
    assert c.labels("1", "2") is c.labels("1", "2")
    with pytest.raises(ValueError, match="expected labels"):
        c.labels("only-one")
