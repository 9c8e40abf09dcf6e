"""Pods → rank endpoints, pool spec parsing and the standalone selector (no API server needed)."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.store import EndpointStore
from epp.k8s.pods import PodEndpoints, PoolSpec, is_ready, parse_target_ports
from epp.k8s.pool_discovery import parse_endpoint_selector, parse_pool_spec

SPEC = PoolSpec(selector={"app": "vllm"}, target_ports=(8000,))


def pod(
    name: str,
    ip: str = "10.0.0.1",
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": labels or {"app": "vllm"}}
    if annotations:
        meta["annotations"] = annotations
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T10:00:00Z"
    return {
        "metadata": meta,
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def handler(spec: PoolSpec | None = SPEC, **kw: Any) -> tuple[PodEndpoints, EndpointStore]:
    store = EndpointStore()
    h = PodEndpoints(store, "ns", **kw)
    h.set_spec(spec)
    return h, store


def test_ready_pod_becomes_one_rank_endpoint_per_target_port() -> None:
    h, store = handler(PoolSpec(selector={"app": "vllm"}, target_ports=(8000, 8001)))
    h.on_upsert(pod("p1", labels={"app": "vllm", "llm-d.ai/role": "decode"}))
    got = {e.metadata.key: e.metadata for e in store.endpoints()}
    assert sorted(got) == ["ns/p1-rank-0", "ns/p1-rank-1"]
    assert got["ns/p1-rank-1"].hostport == "10.0.0.1:8001"
    assert got["ns/p1-rank-0"].pod_name == "p1"
    assert got["ns/p1-rank-0"].labels["llm-d.ai/role"] == "decode"
    assert got["ns/p1-rank-0"].metrics_hostport == "10.0.0.1:8000"


def test_single_port_is_still_suffixed_and_metrics_port_applies_only_then() -> None:
    h, store = handler(metrics_port=9100)
    h.on_upsert(pod("p1"))
    (e,) = store.endpoints()
    assert e.metadata.key == "ns/p1-rank-0"
    assert e.metadata.metrics_hostport == "10.0.0.1:9100"
    h2, store2 = handler(PoolSpec(selector={"app": "vllm"}, target_ports=(8000, 8001)), metrics_port=9100)
    h2.on_upsert(pod("p1"))
    assert {e.metadata.metrics_hostport for e in store2.endpoints()} == {"10.0.0.1:8000", "10.0.0.1:8001"}


@pytest.mark.parametrize(
    "variant",
    [
        {"ready": False},
        {"deleting": True},
        {"ip": ""},
        {"labels": {"app": "other"}},
    ],
)
def test_pod_leaves_when_not_ready_terminating_without_ip_or_not_matching(variant: dict[str, Any]) -> None:
    h, store = handler()
    h.on_upsert(pod("p1"))
    assert len(store) == 1
    h.on_upsert(pod("p1", **variant))
    assert len(store) == 0


def test_removed_endpoint_releases_plugin_state_through_the_store_listener() -> None:
    h, store = handler()
    removed: list[str] = []
    store.subscribe(on_remove=lambda e: removed.append(e.metadata.key))
    h.on_upsert(pod("p1"))
    h.on_delete(pod("p1"))
    assert removed == ["ns/p1-rank-0"] and len(store) == 0


def test_ip_change_replaces_the_endpoint_and_relabel_keeps_it() -> None:
    h, store = handler()
    h.on_upsert(pod("p1", "10.0.0.1"))
    first = store.endpoints()[0]
    first.inflight = 3
    h.on_upsert(pod("p1", "10.0.0.1", labels={"app": "vllm", "x": "y"}))
    assert store.endpoints()[0] is first and first.metadata.labels["x"] == "y"
    h.on_upsert(pod("p1", "10.0.0.9"))
    (second,) = store.endpoints()
    assert second is not first and second.hostport == "10.0.0.9:8000" and second.inflight == 0


def test_active_ports_annotation_restricts_ranks() -> None:
    spec = PoolSpec(selector={"app": "vllm"}, target_ports=(8000, 8001, 8002))
    h, store = handler(spec)
    h.on_upsert(pod("p1", annotations={"llm-d.ai/active-ports": "8000, 8002"}))
    assert sorted(e.metadata.key for e in store.endpoints()) == ["ns/p1-rank-0", "ns/p1-rank-2"]
    assert sorted(e.metadata.rank for e in store.endpoints()) == [0, 2]  # the port's index, not a count
    h.on_upsert(pod("p1", annotations={"inference.networking.k8s.io/active-ports": "8001,bogus"}))
    assert [e.metadata.key for e in store.endpoints()] == ["ns/p1-rank-1"]


def test_target_port_change_removes_orphaned_ranks_and_adds_new_ones() -> None:
    h, store = handler(PoolSpec(selector={"app": "vllm"}, target_ports=(8000, 8001, 8002)))
    h.on_upsert(pod("p1"))
    h.on_upsert(pod("p2", "10.0.0.2"))
    assert len(store) == 6
    h.set_spec(PoolSpec(selector={"app": "vllm"}, target_ports=(9000,)))
    assert sorted(e.hostport for e in store.endpoints()) == ["10.0.0.1:9000", "10.0.0.2:9000"]
    h.clear()
    assert len(store) == 0


def test_ipv6_pod_address_is_bracketed() -> None:
    h, store = handler()
    h.on_upsert(pod("p1", "fd00::5"))
    assert store.endpoints()[0].hostport == "[fd00::5]:8000"


def test_is_ready_needs_the_ready_condition_true() -> None:
    p = pod("p1")
    p["status"]["conditions"] = [{"type": "ContainersReady", "status": "True"}]
    assert not is_ready(p)
    assert is_ready(pod("p1"))


def test_parse_pool_spec_reads_v1_fields_and_names_bad_ones() -> None:
    pool = {
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "appProtocol": "kubernetes.io/h2c",
        }
    }
    spec = parse_pool_spec(pool)
    assert spec.target_ports == (8000, 8001) and spec.app_protocol == "kubernetes.io/h2c"
    assert spec.label_selector == "app=vllm"
    with pytest.raises(ValueError, match=r"spec.targetPorts: duplicate port number 8000"):
        parse_pool_spec(
            {"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}] * 2}}
        )
    with pytest.raises(ValueError, match=r"spec.selector.matchLabels"):
        parse_pool_spec({"spec": {"selector": {}, "targetPorts": [{"number": 8000}]}})
    with pytest.raises(ValueError, match=r"1 to 8 entries, got 9"):
        parse_target_ports(list(range(8000, 8009)))
    with pytest.raises(ValueError, match=r"invalid port number 0"):
        parse_target_ports([0])


def test_endpoint_selector_syntax() -> None:
    assert parse_endpoint_selector("app=vllm, tier==gpu") == {"app": "vllm", "tier": "gpu"}
    with pytest.raises(ValueError, match="expected key=value"):
        parse_endpoint_selector("app")
    with pytest.raises(ValueError, match="empty"):
        parse_endpoint_selector(" , ")
    assert parse_endpoint_selector("app.kubernetes.io/name=vllm") == {"app.kubernetes.io/name": "vllm"}
    for bad, what in [("app!=x", "label key"), ("a=b=c", "label value"), ("-a=b", "label key")]:
        with pytest.raises(ValueError, match=what):
            parse_endpoint_selector(bad)


def test_parse_v1alpha2_pool_spec() -> None:
    spec = parse_pool_spec({"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}})
    assert spec.selector == {"app": "vllm"} and spec.target_ports == (8000,)
    with pytest.raises(ValueError, match=r"spec.targetPortNumber: invalid port number 0"):
        parse_pool_spec({"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 0}})
