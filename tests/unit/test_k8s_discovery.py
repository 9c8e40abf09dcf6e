"""Kubernetes discovery against the in-process fake API server (real kubernetes-asyncio client).

Covers the issue's list: pods scaling up and down, readiness flips, a pool selector change, target
port changes, pool deletion, a dropped watch mid-stream, 410 Gone (relist with diff), standalone
mode, the alpha resources and in-cluster configuration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.rewrites import RewriteStore
from epp.datalayer.store import EndpointStore
from epp.k8s.client import KubeConfigError, api_client
from epp.k8s.pods import PoolSpec
from epp.k8s.policy_watchers import PolicyWatchers
from epp.k8s.pool_discovery import PoolDiscovery
from epp.k8s.resources import POD, call, read_json
from tests.fakekube import FakeKube, objects
from tests.unit.polling import until

NS = "ns"
POOL_API = objects.POOL_API
ALPHA_API = objects.ALPHA_API


def pool_obj(
    name: str = "pool", selector: dict[str, str] | None = None, ports: tuple[int, ...] = (8000,)
) -> dict[str, Any]:
    return objects.inference_pool(NS, ports, name=name, selector=selector)


def pod_obj(
    name: str, ip: str, *, ready: bool = True, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return objects.pod(NS, name, ip, ready=ready, labels=labels)


def set_ready(kube: FakeKube, name: str, ready: bool) -> None:
    kube.patch("v1", "Pod", NS, name, objects.readiness_patch(ready))


class Watcher:
    """A started discovery with its store, status history and per-key add counts."""

    def __init__(self, discovery: PoolDiscovery) -> None:
        self.discovery = discovery
        self.store = EndpointStore()
        self.statuses: list[tuple[bool, str]] = []
        self.adds: Counter[str] = Counter()
        self.store.subscribe(on_add=lambda e: self.adds.update([e.metadata.key]))
        discovery.on_status = lambda ok, why: self.statuses.append((ok, why))

    def names(self) -> set[str]:
        return {e.metadata.key for e in self.store.endpoints()}

    def hostports(self) -> set[str]:
        return {e.hostport for e in self.store.endpoints()}

    async def until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        await until(
            predicate, timeout, lambda: f"endpoints={sorted(self.names())} status={self.statuses[-3:]}"
        )


@pytest.fixture
async def watch(api: client.ApiClient) -> AsyncIterator[Callable[..., Any]]:
    started: list[PoolDiscovery] = []

    async def make(**kw: Any) -> Watcher:
        d = PoolDiscovery(api, NS, **({"pool_name": "pool"} | kw))
        w = Watcher(d)
        await d.start(w.store)
        started.append(d)
        return w

    yield make
    for d in started:
        await d.stop()


async def test_pool_mode_scales_pods_up_and_down_and_follows_readiness(kube: FakeKube, watch: Any) -> None:
    kube.create(pool_obj(ports=(8000, 8001)))
    kube.create(pod_obj("a", "10.0.0.1"))
    kube.create(pod_obj("b", "10.0.0.2", ready=False))
    kube.create(pod_obj("other", "10.0.0.9", labels={"app": "else"}))
    w = await watch()
    await w.until(lambda: w.discovery.ready)
    assert w.names() == {"ns/a-rank-0", "ns/a-rank-1"}
    assert w.statuses[-1][0] is True and "synced" in w.statuses[-1][1]

    kube.create(pod_obj("c", "10.0.0.3"))  # scale up
    await w.until(lambda: "ns/c-rank-1" in w.names())
    set_ready(kube, "b", True)  # readiness flips on
    await w.until(lambda: "ns/b-rank-0" in w.names())
    set_ready(kube, "a", False)  # and off
    await w.until(lambda: not any(k.startswith("ns/a-") for k in w.names()))
    kube.delete("v1", "Pod", NS, "c")  # scale down
    await w.until(lambda: w.names() == {"ns/b-rank-0", "ns/b-rank-1"})
    assert w.hostports() == {"10.0.0.2:8000", "10.0.0.2:8001"}
    assert all(n == 1 for n in w.adds.values()), w.adds


async def test_missing_pool_is_waited_for_not_ready_then_served(kube: FakeKube, watch: Any) -> None:
    kube.create(pod_obj("a", "10.0.0.1"))
    w = await watch()
    await w.until(lambda: any("not found" in why for _, why in w.statuses))
    assert not w.discovery.ready and len(w.store) == 0
    kube.create(pool_obj())
    await w.until(lambda: w.discovery.ready)
    assert w.names() == {"ns/a-rank-0"}


async def test_pool_selector_change_resyncs_the_pods(kube: FakeKube, watch: Any) -> None:
    kube.create(pool_obj(selector={"app": "blue"}))
    kube.create(pod_obj("blue-1", "10.0.0.1", labels={"app": "blue"}))
    kube.create(pod_obj("green-1", "10.0.0.2", labels={"app": "green"}))
    w = await watch()
    await w.until(lambda: w.names() == {"ns/blue-1-rank-0"})
    kube.patch(
        POOL_API, "InferencePool", NS, "pool", {"spec": {"selector": {"matchLabels": {"app": "green"}}}}
    )
    await w.until(lambda: w.names() == {"ns/green-1-rank-0"})
    assert w.discovery.ready
    kube.create(pod_obj("green-2", "10.0.0.3", labels={"app": "green"}))  # the new watch is live
    await w.until(lambda: "ns/green-2-rank-0" in w.names())
    # a pod relabelled out of the selector leaves (the filtered watch sends DELETED)
    kube.patch("v1", "Pod", NS, "green-1", {"metadata": {"labels": {"app": "blue"}}})
    await w.until(lambda: w.names() == {"ns/green-2-rank-0"})


async def test_target_port_change_replaces_ranks(kube: FakeKube, watch: Any) -> None:
    kube.create(pool_obj(ports=(8000, 8001, 8002)))
    kube.create(pod_obj("a", "10.0.0.1"))
    w = await watch()
    await w.until(lambda: len(w.names()) == 3)
    kube.patch(POOL_API, "InferencePool", NS, "pool", {"spec": {"targetPorts": [{"number": 9000}]}})
    await w.until(lambda: w.hostports() == {"10.0.0.1:9000"})
    assert w.names() == {"ns/a-rank-0"}


async def test_pool_deletion_clears_the_store_and_readiness(kube: FakeKube, watch: Any) -> None:
    kube.create(pool_obj())
    kube.create(pod_obj("a", "10.0.0.1"))
    w = await watch()
    await w.until(lambda: w.discovery.ready)
    kube.delete(POOL_API, "InferencePool", NS, "pool")
    await w.until(lambda: not w.discovery.ready and len(w.store) == 0)
    assert "not found" in w.discovery.reason
    kube.create(pool_obj())  # recreated: served again
    await w.until(lambda: w.discovery.ready and w.names() == {"ns/a-rank-0"})


async def test_invalid_pool_spec_or_unsupported_protocol_is_not_ready(kube: FakeKube, watch: Any) -> None:
    bad = pool_obj()
    bad["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    kube.create(bad)
    kube.create(pod_obj("a", "10.0.0.1"))
    w = await watch()
    await w.until(lambda: "duplicate port number 8000" in w.discovery.reason)
    assert len(w.store) == 0
    kube.patch(
        POOL_API,
        "InferencePool",
        NS,
        "pool",
        {"spec": {"targetPorts": [{"number": 8000}], "appProtocol": "grpc-only"}},
    )
    await w.until(lambda: "appProtocol" in w.discovery.reason)
    assert not w.discovery.ready
    kube.patch(POOL_API, "InferencePool", NS, "pool", {"spec": {"appProtocol": "http"}})
    await w.until(lambda: w.discovery.ready)


async def test_pool_without_app_protocol_serves_h2c_only_parsers(kube: FakeKube, watch: Any) -> None:
    """An unset appProtocol constrains nothing (as the reference): a vLLM gRPC EPP becomes ready."""
    pool = pool_obj()
    pool["spec"].pop("appProtocol", None)
    kube.create(pool)
    kube.create(pod_obj("a", "10.0.0.1"))
    w = await watch(app_protocols=("kubernetes.io/h2c",))
    await w.until(lambda: w.discovery.ready and w.names() == {"ns/a-rank-0"})
    kube.patch(POOL_API, "InferencePool", NS, "pool", {"spec": {"appProtocol": "http"}})
    await w.until(lambda: not w.discovery.ready and "appProtocol" in w.discovery.reason)


async def test_dropped_watch_mid_stream_loses_and_duplicates_nothing(kube: FakeKube, watch: Any) -> None:
    kube.create(pool_obj())
    for i in range(3):
        kube.create(pod_obj(f"p{i}", f"10.0.0.{i + 1}"))
    w = await watch()
    await w.until(lambda: len(w.names()) == 3)
    reflector = w.discovery.pod_reflector
    assert reflector is not None
    lists_before = reflector.lists
    for round_ in range(3):
        await w.until(lambda: kube.open_watches("Pod") >= 1)
        assert kube.drop_watches() >= 1
        kube.create(pod_obj(f"new{round_}", f"10.0.1.{round_ + 1}"))
        kube.delete("v1", "Pod", NS, f"p{round_}")
    await w.until(lambda: w.names() == {"ns/new0-rank-0", "ns/new1-rank-0", "ns/new2-rank-0"})
    assert all(n == 1 for n in w.adds.values()), w.adds
    # reconnects resumed from the last resourceVersion: no relist was needed
    assert reflector.lists == lists_before


async def test_410_gone_relists_and_the_diff_catches_up(kube: FakeKube, watch: Any) -> None:
    kube.create(pool_obj())
    kube.create(pod_obj("a", "10.0.0.1"))
    kube.create(pod_obj("b", "10.0.0.2"))
    w = await watch()
    await w.until(lambda: len(w.names()) == 2)
    reflector = w.discovery.pod_reflector
    assert reflector is not None
    lists_before = reflector.lists
    # Changes the reflector cannot replay: history compacted, then the connection drops.
    await w.until(lambda: kube.open_watches("Pod") >= 1)
    kube.compact()
    assert kube.drop_watches() >= 1
    kube.delete("v1", "Pod", NS, "a")
    kube.create(pod_obj("c", "10.0.0.3"))
    kube.compact()
    await w.until(lambda: w.names() == {"ns/b-rank-0", "ns/c-rank-0"})
    await w.until(lambda: reflector.lists > lists_before)
    assert w.adds["ns/b-rank-0"] == 1  # unchanged by the relist
    assert w.discovery.ready


async def test_standalone_selector_mode_watches_pods_only(kube: FakeKube, watch: Any) -> None:
    kube.create(pod_obj("a", "10.0.0.1", labels={"app": "vllm", "role": "decode"}))
    kube.create(pod_obj("b", "10.0.0.2", labels={"app": "vllm"}))
    w = await watch(pool_name="", spec=PoolSpec(selector={"role": "decode"}, target_ports=(8000, 8001)))
    await w.until(lambda: w.discovery.ready)
    assert w.names() == {"ns/a-rank-0", "ns/a-rank-1"}
    assert not any("inferencepools" in path for _, path, _ in kube.requests)


async def test_objectives_and_rewrites_follow_their_objects(kube: FakeKube, api: client.ApiClient) -> None:
    objectives = ObjectiveStore(pool_name="pool", pool_group="inference.networking.k8s.io")
    rewrites = RewriteStore(pool_name="pool", pool_group="inference.networking.k8s.io")
    kube.create(objects.objective(NS, "batch", -1))
    watchers = PolicyWatchers(api, NS, objectives=objectives, rewrites=rewrites)
    watchers.start()
    try:
        await until(lambda: objectives.priority("batch") == -1)
        assert objectives.priority("batch") == -1
        kube.create(objects.model_rewrite(NS, "rw", "llama", {"llama-v2": 1}))
        import random

        rng = random.Random(1)
        await until(lambda: rewrites.choose("llama", rng) is not None)
        assert rewrites.choose("llama", rng) == ("llama-v2", "rw")
        kube.delete(objects.POLICY_API, "InferenceObjective", NS, "batch")
        await until(lambda: objectives.priority("batch") == 0)
        assert objectives.priority("batch") == 0
    finally:
        await watchers.stop()


async def test_alpha_kinds_without_crds_do_not_break_discovery(
    kube: FakeKube, watch: Any, api: client.ApiClient
) -> None:
    kube.set_group_installed("inference.networking.x-k8s.io", False)
    kube.set_group_installed("llm-d.ai", False)
    objectives = ObjectiveStore(pool_name="pool", pool_group="inference.networking.k8s.io")
    watchers = PolicyWatchers(api, NS, objectives=objectives)
    watchers.start()
    try:
        kube.create(pool_obj())
        kube.create(pod_obj("a", "10.0.0.1"))
        w = await watch()
        await w.until(lambda: w.discovery.ready)
        assert objectives.priority("anything") == 0
        await until(lambda: "404" in watchers.watches[0].last_error)
        assert watchers.watches[0].kind is None
    finally:
        await watchers.stop()


async def test_in_cluster_service_account_configuration(tmp_path: Path) -> None:
    with FakeKube(tls=True) as kube:
        token, ca = kube.write_incluster_files(tmp_path)
        assert token.parent == ca.parent
        host, port = kube.url.removeprefix("https://").rsplit(":", 1)
        env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
        kube.create(pod_obj("a", "10.0.0.1"))
        api = await api_client(environ=env, service_account_dir=str(token.parent))
        try:
            pods = await read_json(await call(api, POD, NS))
            assert [p["metadata"]["name"] for p in pods["items"]] == ["a"]
        finally:
            await api.close()


async def test_no_configuration_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="pass --kubeconfig"):
        await api_client(environ={"KUBECONFIG": str(tmp_path / "missing")})


async def test_bookmarks_keep_an_idle_watch_resumable_without_a_relist(kube: FakeKube, watch: Any) -> None:
    kube.create(pool_obj())
    kube.create(pod_obj("a", "10.0.0.1"))
    w = await watch()
    await w.until(lambda: w.discovery.ready)
    reflector = w.discovery.pod_reflector
    assert reflector is not None
    lists_before = reflector.lists
    # Activity the pod watch does not see (another namespace) moves the global resourceVersion on.
    for i in range(5):
        kube.create(
            pod_obj(f"elsewhere-{i}", "10.9.0.1") | {"metadata": {"name": f"x{i}", "namespace": "other"}}
        )
    current = kube.get("v1", "Pod", "other", "x4")
    assert current is not None
    target = int(current["metadata"]["resourceVersion"])
    # Only a BOOKMARK can bring the idle watch's resourceVersion up to date.
    await w.until(lambda: int(reflector.resource_version or 0) >= target)
    kube.compact()
    await w.until(lambda: kube.open_watches("Pod") >= 1)
    assert kube.drop_watches() >= 1
    kube.create(pod_obj("b", "10.0.0.2"))
    await w.until(lambda: "ns/b-rank-0" in w.names())
    assert reflector.lists == lists_before  # resumed from the bookmark's version: no 410, no relist


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.synced = 0

    def on_upsert(self, obj: dict[str, Any]) -> None:
        self.events.append(("upsert", obj["metadata"]["name"]))

    def on_delete(self, obj: dict[str, Any]) -> None:
        self.events.append(("delete", obj["metadata"]["name"]))

    def on_synced(self) -> None:
        self.synced += 1


async def test_reflector_pages_lists_and_retries_server_errors(kube: FakeKube, api: client.ApiClient) -> None:
    from epp.k8s.reflector import Reflector

    for i in range(5):
        kube.create(pod_obj(f"p{i}", f"10.0.0.{i + 1}"))
    kube.fail_next("GET", "/pods", status=500, count=2)
    rec = _Recorder()
    reflector = Reflector(api, POD, NS, rec, page_size=2)
    reflector.start()
    try:
        await until(lambda: rec.synced)
        assert rec.synced == 1
        assert sorted(name for _, name in rec.events) == [f"p{i}" for i in range(5)]
        pages = [q for m, p, q in kube.requests if m == "GET" and p.endswith("/pods") and "watch" not in q]
        assert sum(1 for q in pages if q.get("continue")) == 2  # five objects in pages of two
        assert len(pages) == 2 + 3  # two answered 500 (retried with backoff), then three pages
    finally:
        await reflector.stop()


async def test_pre_ga_v1alpha2_inferencepool_with_pool_group_x_k8s(kube: FakeKube, watch: Any) -> None:
    kube.create(
        {
            "apiVersion": ALPHA_API,
            "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": NS},
            "spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000, "extensionRef": {"name": "epp"}},
        }
    )
    kube.create(pod_obj("a", "10.0.0.1"))
    w = await watch(pool_group="inference.networking.x-k8s.io")
    await w.until(lambda: w.discovery.ready)
    assert w.hostports() == {"10.0.0.1:8000"} and w.names() == {"ns/a-rank-0"}
    assert any("/apis/inference.networking.x-k8s.io/v1alpha2/" in path for _, path, _ in kube.requests)


async def test_reflector_survives_an_unexpected_error_and_relists(
    kube: FakeKube, api: client.ApiClient
) -> None:
    from epp.k8s.reflector import Reflector

    rec = _Recorder()
    reflector = Reflector(api, POD, NS, rec)
    original = reflector._event
    failures: list[bytes] = []

    def flaky(line: bytes) -> None:
        if not failures:
            failures.append(line)
            raise RuntimeError("a bug in event handling")
        original(line)

    reflector._event = flaky  # type: ignore[method-assign]
    reflector.start()
    try:
        await until(lambda: rec.synced >= 1)
        kube.create(pod_obj("a", "10.0.0.1"))
        await until(lambda: rec.synced >= 2 and ("upsert", "a") in rec.events)  # listed again
        assert len(failures) == 1 and reflector.lists == 2
        kube.create(pod_obj("b", "10.0.0.2"))
        await until(lambda: ("upsert", "b") in rec.events)
        assert rec.events.count(("upsert", "a")) == 1  # the relist did not repeat it
    finally:
        await reflector.stop()
