"""Bounded request-derived metric labels: served models keep their label, the rest record as 'other'."""

from __future__ import annotations

from collections.abc import Iterator
from types import MappingProxyType

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from epp import labels, metrics, promlite
from epp.datalayer.rewrites import RewriteStore
from epp.datalayer.served_models import ServedModels
from epp.datalayer.store import EndpointStore
from epp.framework import Metrics
from epp.plugins.scraping.core_metrics_extractor import BUILTIN_ENGINES, _compile, extract_metrics
from tests.fakekube.objects import model_rewrite
from tests.unit.factories import metadata


@pytest.fixture(autouse=True)
def _fresh_model_names() -> Iterator[None]:
    labels.MODEL_NAMES.reset()
    yield
    labels.MODEL_NAMES.reset()


def test_unrestricted_admits_up_to_the_limit_then_other() -> None:
    b = labels.BoundedLabel("t", limit=3)
    assert [b.bound(f"m{i}") for i in range(5)] == ["m0", "m1", "m2", "other", "other"]
    assert b.bound("m1") == "m1"  # sticky
    b.pin(["configured"])
    assert b.bound("configured") == "configured"  # pinned values are outside the cap


def test_served_values_restrict_the_set() -> None:
    b = labels.BoundedLabel("t", limit=10)
    assert b.bound("early") == "early"  # nothing known yet: admitted
    b.serve(["llama"])
    assert b.bound("llama") == "llama"
    assert b.bound("junk") == "other"
    assert b.bound("early") == "early"  # admitted before: keeps its label (balanced gauges)
    b.serve(["junk"])  # becomes served later: its own label from then on
    assert b.bound("junk") == "junk"


def test_a_served_name_admitted_before_the_first_scrape_still_restricts() -> None:
    store = EndpointStore()
    store.upsert(metadata("a"))
    assert labels.MODEL_NAMES.bound("base") == "base"  # before anything is known: admitted
    store.endpoints()[0].metrics = Metrics(served_models=("base",))
    ServedModels(store).refresh()
    assert labels.MODEL_NAMES.restricted
    assert labels.MODEL_NAMES.bound("junk") == "other"


def test_zero_limit_folds_everything() -> None:
    b = labels.BoundedLabel("t", limit=0)
    assert b.bound("a") == "other"
    with pytest.raises(ValueError):
        labels.BoundedLabel("t", limit=-1)


def test_bounded_family_keeps_series_bounded_for_thousands_of_names() -> None:
    registry = CollectorRegistry()
    bound = labels.BoundedLabel("t", limit=5)
    bound.serve(["demo"])
    h = promlite.Histogram(
        "h_seconds", "h", ["model_name", "code"], buckets=(1.0,), bounded={"model_name": bound}
    )
    promlite.register(h, registry=registry)
    for i in range(5000):
        h.labels(f"junk-{i}", "200").observe(0.5)
    h.labels("demo", "200").observe(0.5)
    assert len(h) == 2
    text = generate_latest(registry).decode()
    assert 'h_seconds_count{code="200",model_name="other"} 5000.0' in text
    assert 'h_seconds_count{code="200",model_name="demo"} 1.0' in text


def test_combinations_of_bounded_labels_stop_at_the_family_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(promlite, "MAX_BOUNDED_SERIES", 10)
    bound = labels.BoundedLabel("t", limit=100)
    c = promlite.Counter(
        "pairs_total",
        "p",
        ["model_name", "target_model_name"],
        bounded={"model_name": bound, "target_model_name": bound},
    )
    for i in range(20):
        for j in range(20):
            c.labels(f"m{i}", f"m{j}").inc()
    assert len(c) == 11  # ten combinations, then one folded series
    assert c.labels("other", "other").value == 400 - 10
    assert c.labels("m0", "m0").value == 1  # a combination recorded before the cap keeps counting


def test_bounded_label_must_be_a_label() -> None:
    with pytest.raises(ValueError, match="not among"):
        promlite.Counter("c_total", "c", ["a"], bounded={"b": labels.MODEL_NAMES})


def test_request_metrics_bound_incoming_and_target_models() -> None:
    # The request metrics carry fairness_id, priority (the reference's llm_d_epp_* labels) and the pool.
    labels.MODEL_NAMES.serve(["demo"])
    pool = metrics.pool_label("pool-labels")
    series = len(metrics.REQUEST_TOTAL)
    other0 = metrics.REQUEST_TOTAL.labels("other", "other", "f", "0", pool).value
    demo0 = metrics.REQUEST_TOTAL.labels("demo", "demo", "f", "0", pool).value
    for i in range(100):
        metrics.REQUEST_TOTAL.labels(f"junk-{i}", f"target-{i}", "f", "0", pool).inc()
    metrics.REQUEST_TOTAL.labels("demo", "demo", "f", "0", pool).inc()
    assert metrics.REQUEST_TOTAL.labels("other", "other", "f", "0", pool).value - other0 == 100
    assert metrics.REQUEST_TOTAL.labels("demo", "demo", "f", "0", pool).value - demo0 == 1
    assert len(metrics.REQUEST_TOTAL) <= series + 2
    # request_key binds the same way, once per request; the pool's label is bound once per pool
    assert metrics.request_key("junk-x", "demo", "f", -1, pool) == ("other", "demo", "f", "-1", pool)


def test_pool_labels_are_the_served_pools_capped() -> None:
    """Each pool the EPP builds keeps its own ``inference_pool`` label, up to the limit; a name no
    pool was built for (or a pool past the limit) records as ``other``; "" (no pool) stays ""."""
    pools = labels.BoundedLabel("inference_pool", limit=2)
    for name in ("a", "b", "c"):
        pools.serve((name,))
    assert [pools.bound(n) for n in ("a", "b", "c", "junk", "")] == ["a", "b", "other", "other", ""]
    assert pools.bound("a") == "a"  # a removed and re-added pool keeps its label (sticky)
    # the process-wide bound: pool_label serves the name and seeds its unparsed-request error series
    assert metrics.pool_label("pool-cap") == "pool-cap"
    assert labels.INFERENCE_POOLS.bound("never-built-pool") == "other"
    seeded = {v[-1] for v, _ in metrics.REQUEST_ERROR_TOTAL._items() if v[:5] == metrics.no_key("pool-cap")}
    assert {"BadRequest", "NotFound", "ServiceUnavailable"} <= seeded


def test_served_models_come_from_scraped_model_names_and_lora_adapters() -> None:
    store = EndpointStore()
    store.upsert(metadata("a"))
    ep = store.endpoints()[0]
    ep.metrics = Metrics(
        served_models=("base",),
        active_models=MappingProxyType({"lora-1": 0}),
        waiting_models=MappingProxyType({"lora-2": 0}),
    )
    ServedModels(store).refresh()
    for name in ("base", "lora-1", "lora-2"):
        assert labels.MODEL_NAMES.bound(name) == name
    assert labels.MODEL_NAMES.bound("junk") == "other"


def test_extractor_reports_the_model_name_labels_of_running_requests() -> None:
    body = (
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="llama"} 2.0\n'
        b'vllm:num_requests_running{engine="1",model_name="llama"} 1.0\n'
    )
    result = extract_metrics(_compile(BUILTIN_ENGINES["vllm"]), Metrics(), body)
    assert result.metrics is not None
    assert result.metrics.served_models == ("llama",)
    assert result.metrics.running_requests_size == 2


def test_rewrite_models_are_pinned() -> None:
    labels.MODEL_NAMES.serve(["served"])
    store = RewriteStore("pool")
    store.upsert_object(model_rewrite("default", "r", "alias", {"real": 1}))
    assert labels.MODEL_NAMES.bound("alias") == "alias"
    assert labels.MODEL_NAMES.bound("real") == "real"
    assert labels.MODEL_NAMES.bound("junk") == "other"
