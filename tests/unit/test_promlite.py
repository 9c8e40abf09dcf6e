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


def test_exposition_matches_prometheus_client_text() -> None:
    import urllib.request

    from prometheus_client import Gauge

    registry = CollectorRegistry()
    c = promlite.Counter("a_total", "help \\ with\nnewline", ["x"])
    g = promlite.Gauge("b", "gauge", ["x", "y"])
    h = promlite.Histogram("c", "hist", buckets=(0.1, 1))
    h2 = promlite.Histogram("d_seconds", "hist2", ["m", "a", "z"], buckets=(0.005, 1e-5, 2.5))
    e = promlite.Counter("empty_total", "nothing", ["x"])
    n = promlite.Counter("plain", "no suffix")
    promlite.register(c, g, h, h2, e, n, registry=registry)
    Gauge("classic", "classic gauge", registry=registry).set(3)
    c.labels('q"\\\n').inc()
    g.labels("1", "2").set(1e20)
    h.observe(0.5)
    h.observe(float("inf"))
    h2.labels("m", "a", "z").observe(0.3)
    n.inc(2.5)
    reference = generate_latest(registry).decode()
    fast = promlite.exposition(registry).decode()
    assert sorted(fast.split("# HELP")) == sorted(reference.split("# HELP"))
    httpd, _ = promlite.start_http_server(0, "127.0.0.1", registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{httpd.server_port}/metrics", timeout=10) as r:
            assert r.read().decode() == fast
    finally:
        httpd.shutdown()
        httpd.server_close()
