"""Filters and scorers over endpoint data: utilization, endpoint attributes, prefix-cache affinity,
header-label affinity, topology (with ``topology-extractor``)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from epp.config import load_config
from epp.datalayer.store import EndpointStore
from epp.framework import ConfigError, CycleState, Endpoint, MetadataExtractor, Stability
from epp.framework.attributes import (
    INFLIGHT_LOAD_KEY,
    LATENCY_PREDICTION_INFO_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
    InFlightLoad,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from epp.framework.params import decode_params
from epp.plugins.filters.endpoint_attribute_filter import EndpointAttributeFilter
from epp.plugins.filters.prefix_cache_affinity import PrefixCacheAffinityFilter
from epp.plugins.filters.topology_affinity_filter import TopologyAffinityFilter
from epp.plugins.filters.utilization_filter import UtilizationFilter
from epp.plugins.producers.inflight_load import InFlightLoadProducer
from epp.plugins.profile_handlers.disagg import PEER_ENDPOINT_KEY
from epp.plugins.scorers.endpoint_attribute_scorer import EndpointAttributeScorer
from epp.plugins.scorers.header_label_affinity import HeaderLabelAffinityScorer
from epp.plugins.scorers.topology_affinity_scorer import TopologyAffinityScorer
from epp.plugins.scraping.topology_extractor import Topology, TopologyExtractor
from tests.unit.factories import StubHandle, endpoint, known_metrics, metadata, request

WHERE = "plugins[0].parameters"
GPU = "GPUUtilization/dcgm-extractor"


def build(cls: type[Any], raw: dict[str, Any] | None = None, handle: Any = None, name: str = "x") -> Any:
    return cls(name, decode_params(cls.Params, raw, WHERE), handle)


def config_error(cls: type[Any], raw: dict[str, Any] | None, handle: Any = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(cls, raw, handle)
    return info.value


def names(endpoints: list[Endpoint]) -> list[str]:
    return [e.metadata.name for e in endpoints]


# --- utilization-filter --------------------------------------------------------------------------


def test_utilization_filter_drops_endpoints_over_any_cap() -> None:
    pool = [
        endpoint("idle", metrics=known_metrics(running_requests_size=3, kv_cache_usage_percent=0.1)),
        endpoint("busy", metrics=known_metrics(running_requests_size=41)),
        endpoint("queued", metrics=known_metrics(waiting_queue_size=1)),
        endpoint("full", metrics=known_metrics(kv_cache_usage_percent=0.9)),
        endpoint("edge", metrics=known_metrics(running_requests_size=40, kv_cache_usage_percent=0.8)),
    ]
    f = build(
        UtilizationFilter,
        {
            "conditions": [
                {"metric": "running-requests", "maxValue": 40},
                {"metric": "waiting-queue", "maxValue": 0},
                {"metric": "kv-cache-utilization", "maxValue": 0.8},
            ]
        },
    )
    assert names(f.filter(CycleState(), request(), pool)) == ["idle", "edge"]


def test_utilization_filter_active_requests_and_fallback() -> None:
    pool = [endpoint("a"), endpoint("b"), endpoint("c")]
    cycle = CycleState({INFLIGHT_LOAD_KEY: {pool[0]: InFlightLoad(0, 5), pool[1]: InFlightLoad(0, 2)}})
    f = build(UtilizationFilter, {"conditions": [{"metric": "active-requests", "maxValue": 2}]})
    assert f.consumes == frozenset({INFLIGHT_LOAD_KEY})  # the loader creates the producer
    assert names(f.filter(cycle, request(), pool)) == ["b", "c"]  # c has no entry: counts as 0
    strict = build(UtilizationFilter, {"conditions": [{"metric": "active-requests", "maxValue": 0}]})
    assert names(strict.filter(cycle, request(), pool[:2])) == []
    lenient = build(
        UtilizationFilter,
        {"conditions": [{"metric": "active-requests", "maxValue": 0}], "fallbackOnEmpty": True},
    )
    assert names(lenient.filter(cycle, request(), pool[:2])) == ["a", "b"]
    assert build(
        UtilizationFilter, {"conditions": [{"metric": "waiting-queue", "maxValue": 1}]}
    ).consumes == (frozenset())


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        ({}, f"{WHERE}.conditions", "at least one condition"),
        (
            {"conditions": [{"metric": "gpu", "maxValue": 1}]},
            f"{WHERE}.conditions[0].metric",
            "must be one of",
        ),
        ({"conditions": [{"metric": "waiting-queue"}]}, f"{WHERE}.conditions[0].maxValue", "required"),
        (
            {"conditions": [{"metric": "waiting-queue", "maxValue": -1}]},
            f"{WHERE}.conditions[0].maxValue",
            "non-",
        ),
        (
            {"conditions": [{"metric": "kv-cache-utilization", "maxValue": 80}]},
            f"{WHERE}.conditions[0].maxValue",
            "fraction",
        ),
        (
            {"conditions": [{"metric": "waiting-queue", "maxValue": 1}], "inFlightLoadProducerName": "nope"},
            "inFlightLoadProducerName",
            "not found",
        ),
    ],
)
def test_utilization_filter_bad_parameters(raw: dict[str, Any], field: str, reason: str) -> None:
    err = config_error(UtilizationFilter, raw, StubHandle())
    assert err.field == field and reason in err.reason


def test_utilization_filter_producer_name_must_produce_in_flight_load() -> None:
    ok = StubHandle(InFlightLoadProducer("load", None))
    build(
        UtilizationFilter,
        {"conditions": [{"metric": "active-requests", "maxValue": 1}], "inFlightLoadProducerName": "load"},
        ok,
    )
    wrong = StubHandle(
        HeaderLabelAffinityScorer(
            "load", decode_params(HeaderLabelAffinityScorer.Params, {"headerName": "h", "labelKey": "l"}, "p")
        )
    )
    err = config_error(
        UtilizationFilter,
        {"conditions": [{"metric": "active-requests", "maxValue": 1}], "inFlightLoadProducerName": "load"},
        wrong,
    )
    assert err.field == "inFlightLoadProducerName" and "does not produce" in err.reason


# --- endpoint-attribute-filter / -scorer ---------------------------------------------------------


def gpu_pool(*values: float | None) -> list[Endpoint]:
    pool = []
    for i, v in enumerate(values):
        e = endpoint(f"g{i}", f"10.0.1.{i}")
        if v is not None:
            e.attributes[GPU] = v
        pool.append(e)
    return pool


def test_endpoint_attribute_filter_threshold_and_missing_policies() -> None:
    pool = gpu_pool(0.2, 0.95, None, 0.5)
    raw = {
        "attribute": "GPUUtilization",
        "producer": "dcgm-extractor",
        "algorithm": {"type": "threshold", "threshold": {"operator": "LessThan", "value": 0.6}},
    }
    assert names(build(EndpointAttributeFilter, raw).filter(CycleState(), request(), pool)) == [
        "g0",
        "g2",
        "g3",
    ]
    fail = build(EndpointAttributeFilter, {**raw, "onMissing": "Fail"})
    assert names(fail.filter(CycleState(), request(), pool)) == ["g0", "g3"]
    none_pass = {
        **raw,
        "onMissing": "Fail",
        "algorithm": {"type": "threshold", "threshold": {"operator": "GreaterThan", "value": 0.99}},
    }
    assert build(EndpointAttributeFilter, none_pass).filter(CycleState(), request(), pool) == []
    assert (
        build(EndpointAttributeFilter, {**none_pass, "fallbackOnEmpty": True}).filter(
            CycleState(), request(), pool
        )
        == pool
    )


def test_endpoint_attribute_default_producer_is_the_core_metrics_extractor() -> None:
    e = endpoint("c")
    e.attributes["custom.queue_depth/core-metrics-extractor"] = 3
    e.attributes["custom.queue_depth/"] = 100  # a producer-agnostic attribute of the same name
    raw = {
        "attribute": "custom.queue_depth",
        "onMissing": "Fail",
        "algorithm": {"type": "threshold", "threshold": {"operator": "Equal", "value": 3}},
    }
    assert names(build(EndpointAttributeFilter, raw).filter(CycleState(), request(), [e])) == ["c"]
    agnostic = {**raw, "producer": ""}
    assert build(EndpointAttributeFilter, agnostic).filter(CycleState(), request(), [e]) == []


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        (
            {"algorithm": {"type": "threshold", "threshold": {"operator": "LessThan", "value": 1}}},
            WHERE + ".attribute",
            "non-empty",
        ),
        (
            {"attribute": "a/b", "algorithm": {"type": "threshold", "threshold": {"operator": "LessThan"}}},
            WHERE + ".attribute",
            'producer: "b"',
        ),
        (
            {
                "attribute": "a",
                "onMissing": "Drop",
                "algorithm": {"type": "threshold", "threshold": {"operator": "LessThan"}},
            },
            WHERE + ".onMissing",
            "Pass",
        ),
        ({"attribute": "a", "algorithm": {"type": "topK"}}, WHERE + ".algorithm.type", "threshold"),
        ({"attribute": "a"}, WHERE + ".algorithm.type", "threshold"),
        ({"attribute": "a", "algorithm": {"type": "threshold"}}, WHERE + ".algorithm.threshold", "required"),
        (
            {"attribute": "a", "algorithm": {"type": "threshold", "threshold": {"operator": "Less"}}},
            WHERE + ".algorithm.threshold.operator",
            "LessThan",
        ),
    ],
)
def test_endpoint_attribute_filter_bad_parameters(raw: dict[str, Any], field: str, reason: str) -> None:
    err = config_error(EndpointAttributeFilter, raw)
    assert err.field == field and reason in err.reason


def test_endpoint_attribute_scorer_adaptive_and_fixed_ranges() -> None:
    pool = gpu_pool(0.2, 0.8, None, 0.5)
    lower = {
        "attributeKey": "GPUUtilization",
        "producer": "dcgm-extractor",
        "algorithm": {"type": "linear_lower_is_better"},
    }
    assert build(EndpointAttributeScorer, lower).score(CycleState(), request(), pool) == pytest.approx(
        [1.0, 0.0, 0.0, 0.5]
    )
    higher = {**lower, "algorithm": {"type": "linear_higher_is_better"}}
    assert build(EndpointAttributeScorer, higher).score(CycleState(), request(), pool) == pytest.approx(
        [0.0, 1.0, 0.0, 0.5]
    )
    fixed = {
        **lower,
        "algorithm": {
            "type": "linear_lower_is_better",
            "normalization": {"fixedRange": {"min": 0.0, "max": 0.4}},
        },
    }
    assert build(EndpointAttributeScorer, fixed).score(CycleState(), request(), pool) == pytest.approx(
        [0.5, 0.0, 0.0, 0.0]
    )
    same = gpu_pool(0.3, 0.3, None)
    assert build(EndpointAttributeScorer, lower).score(CycleState(), request(), same) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        ({"algorithm": {"type": "linear_lower_is_better"}}, WHERE + ".attributeKey", "non-empty"),
        (
            {"attributeKey": "a", "algorithm": {"type": "log"}},
            WHERE + ".algorithm.type",
            "linear_lower_is_better",
        ),
        (
            {
                "attributeKey": "a",
                "algorithm": {
                    "type": "linear_lower_is_better",
                    "normalization": {"fixedRange": {"min": 1, "max": 1}},
                },
            },
            WHERE + ".algorithm.normalization.fixedRange",
            "min < max",
        ),
        (
            {
                "attributeKey": "a",
                "algorithm": {
                    "type": "linear_lower_is_better",
                    "normalization": {"fixedRange": {"min": 0, "max": 1}, "adaptiveRange": {}},
                },
            },
            WHERE + ".algorithm.normalization",
            "at most one",
        ),
    ],
)
def test_endpoint_attribute_scorer_bad_parameters(raw: dict[str, Any], field: str, reason: str) -> None:
    err = config_error(EndpointAttributeScorer, raw)
    assert err.field == field and reason in err.reason


# --- prefix-cache-affinity-filter ----------------------------------------------------------------


def prefix_cycle(pool: list[Endpoint], ratios: list[int], tokens: list[int] | None = None) -> CycleState:
    cycle = CycleState(
        {
            PREFIX_CACHE_MATCH_INFO_KEY: {
                e: PrefixCacheMatchInfo(m, 10, 16) for e, m in zip(pool, ratios, strict=True)
            }
        }
    )
    if tokens is not None:
        cycle[INFLIGHT_LOAD_KEY] = {e: InFlightLoad(t, 1) for e, t in zip(pool, tokens, strict=True)}
    return cycle


def test_prefix_cache_affinity_keeps_sticky_endpoints() -> None:
    pool = [endpoint("hot"), endpoint("warm"), endpoint("cold")]
    f = build(PrefixCacheAffinityFilter)
    assert names(f.filter(prefix_cycle(pool, [9, 8, 1]), request(), pool)) == ["hot", "warm"]
    assert names(f.filter(prefix_cycle(pool, [7, 5, 1]), request(), pool)) == ["hot", "warm", "cold"]
    strict = build(PrefixCacheAffinityFilter, {"affinityThreshold": 0.9})
    assert names(strict.filter(prefix_cycle(pool, [9, 8, 1]), request(), pool)) == ["hot"]
    assert names(f.filter(CycleState(), request(), pool)) == ["hot", "warm", "cold"]  # no producer data


def test_prefix_cache_affinity_ttft_gate_breaks_overloaded_stickiness() -> None:
    pool = [endpoint("hot"), endpoint("cold")]
    f = build(PrefixCacheAffinityFilter, {"maxTTFTPenaltyMs": 1000, "peakPrefillThroughput": 10000})
    # hot: 20000 in-flight tokens = 2000 ms; cold idle: 0 ms; penalty 2000 > 1000 -> everyone
    assert names(f.filter(prefix_cycle(pool, [9, 0], [20000, 0]), request(), pool)) == ["hot", "cold"]
    # hot: 5000 tokens = 500 ms, within the penalty -> sticky
    assert names(f.filter(prefix_cycle(pool, [9, 0], [5000, 0]), request(), pool)) == ["hot"]
    always = build(PrefixCacheAffinityFilter, {"maxTTFTPenaltyMs": 0})
    assert names(always.filter(prefix_cycle(pool, [9, 0], [10**9, 0]), request(), pool)) == ["hot"]
    assert f.consumes == frozenset({PREFIX_CACHE_MATCH_INFO_KEY, INFLIGHT_LOAD_KEY})
    assert always.consumes == frozenset({PREFIX_CACHE_MATCH_INFO_KEY})


def test_prefix_cache_affinity_exploration_skips_the_gate() -> None:
    pool = [endpoint("hot"), endpoint("cold")]
    f = build(PrefixCacheAffinityFilter, {"explorationProbability": 0.5})
    f.rng = random.Random(7)
    kept = [len(f.filter(prefix_cycle(pool, [9, 0]), request(), pool)) for _ in range(400)]
    assert 120 < kept.count(2) < 280  # about half explore


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"affinityThreshold": 1.5}, "affinityThreshold"),
        ({"explorationProbability": 2}, "explorationProbability"),
        ({"maxTTFTPenaltyMs": -1}, "maxTTFTPenaltyMs"),
        ({"peakPrefillThroughput": 0}, "peakPrefillThroughput"),
        ({"ttftSource": "guess"}, "ttftSource"),
        ({"maxTtftPenaltyMs": 1}, "maxTtftPenaltyMs"),
    ],
)
def test_prefix_cache_affinity_bad_parameters(raw: dict[str, Any], field: str) -> None:
    err = config_error(PrefixCacheAffinityFilter, raw)
    assert err.field == f"{WHERE}.{field}"


def test_prefix_cache_affinity_gate_on_predicted_ttft() -> None:
    pool = [endpoint("hot"), endpoint("cold")]
    f = build(PrefixCacheAffinityFilter, {"ttftSource": "latencyPredictor", "maxTTFTPenaltyMs": 1000})
    assert f.consumes == frozenset({PREFIX_CACHE_MATCH_INFO_KEY, LATENCY_PREDICTION_INFO_KEY})

    def predicted(*ttfts: float) -> CycleState:
        cycle = prefix_cycle(pool, [9, 0], [10**9, 0])  # in-flight tokens are not read
        cycle[LATENCY_PREDICTION_INFO_KEY] = {
            e: LatencyPredictionInfo(True, True, 0.0, 0.0, t, 0.0, 0)
            for e, t in zip(pool, ttfts, strict=True)
        }
        return cycle

    assert names(f.filter(predicted(2500.0, 100.0), request(), pool)) == ["hot", "cold"]  # 2400 > 1000
    assert names(f.filter(predicted(900.0, 100.0), request(), pool)) == ["hot"]
    assert names(f.filter(prefix_cycle(pool, [9, 0]), request(), pool)) == ["hot"]  # no predictions
    build(PrefixCacheAffinityFilter, {"ttftSource": "latencyPredictor", "maxTTFTPenaltyMs": 0})


# --- header-label-affinity-scorer ----------------------------------------------------------------


def test_header_label_affinity_scores_matching_label() -> None:
    pool = [endpoint("a", labels={"zone": "z1"}), endpoint("b", labels={"zone": "z2"}), endpoint("c")]
    s = build(HeaderLabelAffinityScorer, {"headerName": "X-Preferred-Zone", "labelKey": "zone"})
    assert s.score(CycleState(), request(headers={"x-preferred-zone": "z2"}), pool) == [0.0, 1.0, 0.0]
    assert s.score(CycleState(), request(headers={"x-preferred-zone": "z9"}), pool) == [0.0, 0.0, 0.0]
    assert s.score(CycleState(), request(), pool) == [0.0, 0.0, 0.0]
    for raw, field in (({"labelKey": "z"}, "headerName"), ({"headerName": "h"}, "labelKey")):
        assert config_error(HeaderLabelAffinityScorer, raw).field == f"{WHERE}.{field}"


# --- topology ------------------------------------------------------------------------------------


def topo_endpoint(name: str, **labels: str) -> Endpoint:
    keys = {
        "host": "kubernetes.io/hostname",
        "rack": "topology.kubernetes.io/rack",
        "zone": "topology.kubernetes.io/zone",
        "region": "topology.kubernetes.io/region",
    }
    return endpoint(name, labels={keys[k]: v for k, v in labels.items()})


def test_topology_extractor_follows_labels_through_the_store() -> None:
    ext = build(TopologyExtractor, {"rack": "my/rack"}, name="topo")
    assert isinstance(ext, MetadataExtractor)
    store = EndpointStore()
    store.subscribe(on_add=ext.extract_metadata, on_update=ext.extract_metadata)
    store.upsert(metadata("p", labels={"kubernetes.io/hostname": "n1", "my/rack": "r1"}))
    e = store.get("default/p")
    assert e is not None and e.attributes["Topology/topo"] == Topology("n1", "r1", "", "")
    store.upsert(metadata("p", labels={"topology.kubernetes.io/zone": "z"}))  # labels changed
    assert e.attributes["Topology/topo"] == Topology("", "", "z", "")
    store.upsert(metadata("p"))
    assert "Topology/topo" not in e.attributes


def test_topology_filter_keeps_co_located_candidates_or_everyone() -> None:
    ext = build(TopologyExtractor, name="topology-extractor")
    peer = topo_endpoint("decode", host="n1", rack="r1", zone="z1")
    pool = [
        topo_endpoint("same-host", host="n1", rack="r1", zone="z1"),
        topo_endpoint("same-rack", host="n2", rack="r1", zone="z1"),
        topo_endpoint("same-zone", host="n3", rack="r2", zone="z1"),
        topo_endpoint("far", host="n4", rack="r3", zone="z9"),
        endpoint("unknown"),
    ]
    for e in [peer, *pool]:
        ext.extract_metadata(e)
    cycle = CycleState({PEER_ENDPOINT_KEY: peer})
    host = build(TopologyAffinityFilter)
    assert names(host.filter(cycle, request(), pool)) == ["same-host"]
    rack = build(TopologyAffinityFilter, {"minAffinity": "rack"})
    assert names(rack.filter(cycle, request(), pool)) == ["same-host", "same-rack"]
    zone = build(TopologyAffinityFilter, {"minAffinity": "zone"})
    assert names(zone.filter(cycle, request(), pool[1:])) == ["same-rack", "same-zone"]
    # nobody meets the floor, or no peer: fail open
    assert names(host.filter(cycle, request(), pool[3:])) == ["far", "unknown"]
    assert names(host.filter(CycleState(), request(), pool)) == names(pool)
    # another extractor instance's attribute is not read
    other = build(TopologyAffinityFilter, {"topologyProducerName": "other"})
    assert names(other.filter(cycle, request(), pool)) == names(pool)
    assert config_error(TopologyAffinityFilter, {"minAffinity": "pod"}).field == f"{WHERE}.minAffinity"


def test_topology_scorer_proximity_curve() -> None:
    ext = build(TopologyExtractor, name="topology-extractor")
    peer = topo_endpoint("prefill", host="n1", rack="r1", zone="z1", region="eu")
    pool = [
        topo_endpoint("h", host="n1"),
        topo_endpoint("r", host="n2", rack="r1"),
        topo_endpoint("z", zone="z1"),
        topo_endpoint("g", region="eu"),
        topo_endpoint("none", region="us"),
        endpoint("bare"),
    ]
    for e in [peer, *pool]:
        ext.extract_metadata(e)
    s = build(TopologyAffinityScorer)
    assert s.score(CycleState({PEER_ENDPOINT_KEY: peer}), request(), pool) == [1.0, 0.2, 0.05, 0.02, 0.0, 0.0]
    assert s.score(CycleState(), request(), pool) == [0.0] * 6


def test_alpha_types() -> None:
    for cls in (
        UtilizationFilter,
        EndpointAttributeFilter,
        EndpointAttributeScorer,
        HeaderLabelAffinityScorer,
        TopologyExtractor,
        TopologyAffinityFilter,
        TopologyAffinityScorer,
    ):
        assert cls.stability is Stability.ALPHA, cls
    assert PrefixCacheAffinityFilter.stability is Stability.BETA


def test_reference_topology_config_loads_and_prefill_sees_the_decode_peer() -> None:
    text = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: always-disagg-pd-decider}
- {type: topology-extractor}
- {type: topology-affinity-filter}
- {type: topology-affinity-scorer}
- {type: prefill-filter}
- {type: decode-filter}
- {type: max-score-picker}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always-disagg-pd-decider}}}
schedulingProfiles:
- name: prefill
  plugins:
  - {pluginRef: prefill-filter}
  - {pluginRef: topology-affinity-filter}
  - {pluginRef: topology-affinity-scorer}
  - {pluginRef: max-score-picker}
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
"""
    cfg = load_config(text, environ={})
    ext = cfg.plugins["topology-extractor"]
    assert isinstance(ext, MetadataExtractor)
    role = "llm-d.ai/role"
    decode = endpoint("d", labels={role: "decode", "kubernetes.io/hostname": "n1"})
    near = endpoint("p-near", labels={role: "prefill", "kubernetes.io/hostname": "n1"})
    far = endpoint("p-far", labels={role: "prefill", "kubernetes.io/hostname": "n2"})
    for e in (decode, near, far):
        ext.extract_metadata(e)
    for _ in range(10):
        result, err = cfg.scheduler.schedule(CycleState(), request(), [far, decode, near])
        assert err is None and result is not None
        assert result.profile_results["prefill"].target_endpoints == [near]


ALL_TYPES = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: session-id-producer, parameters: {headerName: x-sid}}
- {type: topology-extractor}
- type: session-affinity-scorer
  parameters:
    strategy: session_id
    sessionIdConfig:
      sources: [{header: x-a}, {attribute: SessionIDDataKey, producer: session-id-producer}]
- {type: session-affinity-filter}
- type: utilization-filter
  parameters:
    conditions: [{metric: waiting-queue, maxValue: 3}, {metric: active-requests, maxValue: 10}]
- type: endpoint-attribute-filter
  parameters:
    attribute: GPUUtilization
    producer: dcgm-extractor
    algorithm: {type: threshold, threshold: {operator: LessThan, value: 0.9}}
- type: endpoint-attribute-scorer
  parameters:
    attributeKey: q
    algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 0, max: 10}}}
- {type: prefix-cache-affinity-filter}
- {type: prefix-cache-scorer, parameters: {matchLengthWeight: 0.5}}
- {type: header-label-affinity-scorer, parameters: {headerName: x-zone, labelKey: zone}}
- {type: topology-affinity-filter, parameters: {minAffinity: rack}}
- {type: topology-affinity-scorer}
- {type: header-profile-handler}
- {type: max-score-picker}
schedulingProfiles:
- name: decode
  plugins:
  - {pluginRef: session-affinity-filter}
  - {pluginRef: utilization-filter}
  - {pluginRef: endpoint-attribute-filter}
  - {pluginRef: prefix-cache-affinity-filter}
  - {pluginRef: topology-affinity-filter}
  - {pluginRef: session-affinity-scorer}
  - {pluginRef: endpoint-attribute-scorer}
  - {pluginRef: prefix-cache-scorer}
  - {pluginRef: header-label-affinity-scorer}
  - {pluginRef: topology-affinity-scorer}
  - {pluginRef: max-score-picker}
- name: prefill
  plugins: [{pluginRef: max-score-picker}]
"""


def test_effective_configuration_of_every_new_type_round_trips() -> None:
    cfg = load_config(ALL_TYPES, environ={})
    effective = cfg.effective_yaml()
    assert load_config(effective, environ={}).effective_yaml() == effective
    scorer = cfg.plugins["endpoint-attribute-scorer"]
    assert isinstance(scorer, EndpointAttributeScorer)
    assert scorer.params.algorithm.normalization.adaptive_range is None  # null stays "not set"


def test_topology_extractor_also_takes_endpoint_lifecycle_events() -> None:
    from dataclasses import dataclass as _dc

    @_dc
    class _Event:  # the shape an endpoint-notification source delivers
        type: str
        endpoint: Endpoint

    ext = build(TopologyExtractor, name="topology-extractor")
    e = topo_endpoint("p", zone="z1")
    ext.extract_endpoint(_Event("AddOrUpdate", e))
    assert e.attributes["Topology/topology-extractor"] == Topology(zone="z1")
    ext.extract_endpoint(_Event("Delete", e))
    assert "Topology/topology-extractor" not in e.attributes
    ext.extract_endpoint(object())  # not an event: ignored
