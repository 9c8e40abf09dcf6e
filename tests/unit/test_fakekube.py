"""The fake Kubernetes API server, driven by the real ``kubernetes_asyncio`` client."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

from tests.fakekube import FakeKube

NS = "default"
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
POOL_API = f"{POOL_GROUP}/{POOL_VERSION}"
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def pod(name: str, namespace: str = NS, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "vllm"}]},
    }


def pool(name: str, **spec: Any) -> dict[str, Any]:
    spec = spec or {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}
    return {
        "apiVersion": POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def status_of(err: ApiException) -> dict[str, Any]:
    assert err.body is not None
    body = json.loads(err.body)
    assert body["kind"] == "Status" and body["apiVersion"] == "v1" and body["status"] == "Failure"
    assert body["code"] == err.status
    return body


async def raw(func: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> aiohttp.ClientResponse:
    """Call a client API function with ``_preload_content=False``: the raw aiohttp response."""
    return cast(aiohttp.ClientResponse, await func(*args, _preload_content=False, **kwargs))


async def next_event(resp: aiohttp.ClientResponse, timeout: float = 5.0) -> dict[str, Any]:
    line = await asyncio.wait_for(resp.content.readline(), timeout)
    assert line.endswith(b"\n"), f"stream ended: {line!r}"
    event: dict[str, Any] = json.loads(line)
    return event


async def client_for(fake: FakeKube, tmp_path: Path) -> client.ApiClient:
    cfg = client.Configuration()
    await config.load_kube_config(
        config_file=str(fake.write_kubeconfig(tmp_path / "kubeconfig")), client_configuration=cfg
    )
    return client.ApiClient(cfg)


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=0.2) as server:
        yield server


@pytest.fixture
async def api(fake: FakeKube, tmp_path: Path) -> AsyncIterator[client.ApiClient]:
    api_client = await client_for(fake, tmp_path)
    async with api_client:
        yield api_client


# ------------------------------------------------------------------------------------------ objects


def test_create_fills_server_metadata_and_rejects_duplicates(fake: FakeKube) -> None:
    created = fake.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}, "spec": {}})
    meta = created["metadata"]
    assert meta["namespace"] == "default" and meta["generation"] == 1
    assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"]) and RFC3339.match(meta["creationTimestamp"])
    assert meta["resourceVersion"] == fake.resource_version
    with pytest.raises(KeyError):
        fake.create(pod("a"))
    assert fake.get("v1", "Pod", NS, "a") == created
    assert fake.get("v1", "Pod", NS, "missing") is None


def test_resource_version_is_global_and_generation_tracks_spec(fake: FakeKube) -> None:
    rvs = [
        int(fake.create(pod("a"))["metadata"]["resourceVersion"]),
        int(fake.create(pool("p"))["metadata"]["resourceVersion"]),
        int(
            fake.patch("v1", "Pod", NS, "a", {"metadata": {"labels": {"x": "1"}}})["metadata"][
                "resourceVersion"
            ]
        ),
    ]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    relabelled = fake.get(POOL_API, "InferencePool", NS, "p")
    assert relabelled is not None
    relabelled["metadata"]["labels"] = {"tier": "gold"}
    assert fake.apply(relabelled)["metadata"]["generation"] == 1  # metadata only
    changed = fake.apply(pool("p", selector={"matchLabels": {"app": "other"}}, targetPorts=[{"number": 9}]))
    assert changed["metadata"]["generation"] == 2
    assert int(changed["metadata"]["resourceVersion"]) > rvs[-1]
    assert fake.apply(pool("q"))["metadata"]["generation"] == 1  # apply creates too
    fake.delete(POOL_API, "InferencePool", NS, "q")
    assert [p["metadata"]["name"] for p in fake.list(POOL_API, "InferencePool", NS)] == ["p"]
    with pytest.raises(KeyError):
        fake.delete(POOL_API, "InferencePool", NS, "q")


def test_helpers_are_thread_safe(fake: FakeKube) -> None:
    def make(prefix: str) -> None:
        for i in range(50):
            fake.create(pod(f"{prefix}-{i}"))

    threads = [threading.Thread(target=make, args=(f"t{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pods = fake.list("v1", "Pod", None)
    assert len(pods) == 200
    assert len({p["metadata"]["resourceVersion"] for p in pods}) == 200


def test_wait_for_times_out_with_assertion_error(fake: FakeKube) -> None:
    with pytest.raises(AssertionError):
        fake.wait_for(lambda: False, timeout=0.05)
    fake.wait_for(lambda: True)


# ------------------------------------------------------------------------------------------ list


async def test_list_with_label_and_field_selectors(fake: FakeKube, api: client.ApiClient) -> None:
    fake.create(pod("a", app="vllm", tier="gpu"))
    fake.create(pod("b", app="vllm"))
    fake.create(pod("c", app="sgl", tier="cpu"))
    fake.create(pod("d"))
    fake.create(pod("e", namespace="other", app="vllm"))
    v1 = client.CoreV1Api(api)

    async def names(selector: str) -> list[str]:
        result = await v1.list_namespaced_pod(NS, label_selector=selector)
        return [p.metadata.name for p in result.items]

    assert await names("app=vllm") == ["a", "b"]
    assert await names("app==vllm") == ["a", "b"]
    assert await names("app!=vllm") == ["c", "d"]  # != matches pods without the label
    assert await names("tier") == ["a", "c"]
    assert await names("!tier") == ["b", "d"]
    assert await names("app in (vllm, sgl)") == ["a", "b", "c"]
    assert await names("app notin (vllm)") == ["c", "d"]
    assert await names("app=vllm,tier=gpu") == ["a"]
    assert await names("app=vllm, !tier") == ["b"]
    assert await names("") == ["a", "b", "c", "d"]

    everywhere = await v1.list_pod_for_all_namespaces(field_selector="metadata.name=e")
    assert [(p.metadata.namespace, p.metadata.name) for p in everywhere.items] == [("other", "e")]
    not_a = await v1.list_pod_for_all_namespaces(field_selector="metadata.name!=a,metadata.namespace=default")
    assert [p.metadata.name for p in not_a.items] == ["b", "c", "d"]

    response = await raw(v1.list_namespaced_pod, NS, label_selector="app=sgl")
    body = json.loads(await response.read())
    assert body["kind"] == "PodList" and body["apiVersion"] == "v1"
    assert body["metadata"]["resourceVersion"] == fake.resource_version
    assert [(i["apiVersion"], i["kind"]) for i in body["items"]] == [("v1", "Pod")]


@pytest.mark.parametrize(
    ("label_selector", "field_selector"),
    [
        ("app in ()", ""),
        ("app=vllm,", ""),
        ("=x", ""),
        ("app vllm", ""),
        ("a b c", ""),
        ("x/y/z=1", ""),
        ("", "spec.image=x"),
        ("", "metadata.name"),
    ],
)
async def test_invalid_selectors_are_bad_requests(
    api: client.ApiClient, label_selector: str, field_selector: str
) -> None:
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).list_namespaced_pod(
            NS, label_selector=label_selector, field_selector=field_selector
        )
    assert err.value.status == 400
    assert status_of(err.value)["reason"] == "BadRequest"


async def test_pagination_is_a_consistent_snapshot(fake: FakeKube, api: client.ApiClient) -> None:
    for name in "abcde":
        fake.create(pod(name))
    v1 = client.CoreV1Api(api)
    first = await v1.list_namespaced_pod(NS, limit=2)
    list_rv = first.metadata.resource_version
    assert [p.metadata.name for p in first.items] == ["a", "b"]
    assert first.metadata.remaining_item_count == 3 and first.metadata._continue

    fake.delete("v1", "Pod", NS, "c")  # the continued list still shows the state at list_rv
    fake.create(pod("bb"))
    second = await v1.list_namespaced_pod(NS, limit=2, _continue=first.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["c", "d"]
    assert second.metadata.resource_version == list_rv
    third = await v1.list_namespaced_pod(NS, limit=2, _continue=second.metadata._continue)
    assert [p.metadata.name for p in third.items] == ["e"]
    assert not third.metadata._continue

    fresh = await v1.list_namespaced_pod(NS)
    assert [p.metadata.name for p in fresh.items] == ["a", "b", "bb", "d", "e"]
    exact = await v1.list_namespaced_pod(NS, resource_version=list_rv, resource_version_match="Exact")
    assert [p.metadata.name for p in exact.items] == ["a", "b", "c", "d", "e"]


async def test_expired_continue_token_is_410(fake: FakeKube, api: client.ApiClient) -> None:
    for name in "abc":
        fake.create(pod(name))
    v1 = client.CoreV1Api(api)
    first = await v1.list_namespaced_pod(NS, limit=1)
    fake.create(pod("z"))
    fake.compact()
    with pytest.raises(ApiException) as err:
        await v1.list_namespaced_pod(NS, limit=1, _continue=first.metadata._continue)
    assert err.value.status == 410
    assert status_of(err.value)["reason"] == "Expired"
    with pytest.raises(ApiException) as bad:
        await v1.list_namespaced_pod(NS, limit=1, _continue="not-a-token")
    assert bad.value.status == 400


# ------------------------------------------------------------------------------------------ watch


async def test_watch_class_sees_initial_state_then_live_changes(
    fake: FakeKube, api: client.ApiClient
) -> None:
    fake.create(pod("a", app="vllm"))
    v1 = client.CoreV1Api(api)
    seen: list[tuple[str, str, str]] = []
    async with watch.Watch() as w:
        async for event in w.stream(v1.list_namespaced_pod, NS, timeout_seconds=5):
            obj = event["object"]
            assert isinstance(obj, client.V1Pod)
            seen.append((event["type"], obj.metadata.name, obj.metadata.resource_version))
            if len(seen) == 1:
                fake.create(pod("b"))
                fake.patch("v1", "Pod", NS, "a", {"metadata": {"labels": {"app": "sgl"}}})
                fake.delete("v1", "Pod", NS, "b")
            if len(seen) == 4:
                w.stop()
                break
    assert [(t, n) for t, n, _ in seen] == [
        ("ADDED", "a"),
        ("ADDED", "b"),
        ("MODIFIED", "a"),
        ("DELETED", "b"),
    ]
    rvs = [int(rv) for _, _, rv in seen]
    assert rvs == sorted(rvs) and rvs[-1] == int(fake.resource_version)  # DELETED carries a new RV
    assert w.resource_version == fake.resource_version


async def test_raw_watch_stream_is_chunked_json_lines(fake: FakeKube, api: client.ApiClient) -> None:
    fake.create(pod("a"))
    resp = await raw(client.CoreV1Api(api).list_namespaced_pod, NS, watch=True)
    try:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "application/json"
        assert resp.headers["Transfer-Encoding"] == "chunked"
        added = await next_event(resp)
        assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "a"
        assert added["object"]["kind"] == "Pod" and added["object"]["apiVersion"] == "v1"
        await fake.wait_for_async(lambda: fake.open_watches("Pod") == 1)
        assert fake.open_watches("Lease") == 0
        fake.patch("v1", "Pod", NS, "a", {"status": {"phase": "Running"}})
        modified = await next_event(resp)
        assert modified["type"] == "MODIFIED" and modified["object"]["status"] == {"phase": "Running"}
    finally:
        resp.release()
    await fake.wait_for_async(lambda: fake.open_watches() == 0)  # a client hang-up ends the watch


async def test_watch_replays_history_after_resource_version(fake: FakeKube, api: client.ApiClient) -> None:
    rv = fake.create(pod("a"))["metadata"]["resourceVersion"]
    fake.create(pool("p"))  # another kind: not replayed on a pod watch
    fake.patch("v1", "Pod", NS, "a", {"metadata": {"labels": {"v": "2"}}})
    fake.create(pod("b"))
    fake.delete("v1", "Pod", NS, "a")
    resp = await raw(client.CoreV1Api(api).list_namespaced_pod, NS, watch=True, resource_version=rv)
    try:
        events = [await next_event(resp) for _ in range(3)]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("MODIFIED", "a"),
            ("ADDED", "b"),
            ("DELETED", "a"),
        ]
        assert events[0]["object"]["metadata"]["labels"] == {"v": "2"}
        fake.create(pod("c"))  # then live events
        live = await next_event(resp)
        assert (live["type"], live["object"]["metadata"]["name"]) == ("ADDED", "c")
    finally:
        resp.release()


async def test_bookmarks_carry_the_current_resource_version(fake: FakeKube, api: client.ApiClient) -> None:
    fake.create(pod("a"))
    resp = await raw(client.CoreV1Api(api).list_namespaced_pod, NS, watch=True, allow_watch_bookmarks=True)
    try:
        assert (await next_event(resp))["type"] == "ADDED"
        fake.create(pool("p"))  # moves the global RV without a pod event
        bookmark = await next_event(resp, timeout=2)
        assert bookmark["type"] == "BOOKMARK"
        assert bookmark["object"] == {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": fake.resource_version},
        }
    finally:
        resp.release()
    plain = await raw(client.CoreV1Api(api).list_namespaced_pod, NS, watch=True)
    try:
        assert (await next_event(plain))["type"] == "ADDED"
        await asyncio.sleep(0.5)  # 2.5 bookmark intervals
        fake.create(pod("b"))
        assert (await next_event(plain))["type"] == "ADDED"  # no bookmarks unless asked for
    finally:
        plain.release()


async def test_send_initial_events_ends_with_a_marked_bookmark(fake: FakeKube, api: client.ApiClient) -> None:
    fake.create(pod("a"))
    fake.create(pod("b"))
    list_rv = fake.resource_version
    v1 = client.CoreV1Api(api)
    resp = await raw(
        v1.list_namespaced_pod,
        NS,
        watch=True,
        send_initial_events=True,
        resource_version_match="NotOlderThan",
        allow_watch_bookmarks=True,
    )
    try:
        events = [await next_event(resp) for _ in range(3)]
        assert [e["type"] for e in events] == ["ADDED", "ADDED", "BOOKMARK"]
        assert events[2]["object"]["metadata"] == {
            "resourceVersion": list_rv,
            "annotations": {"k8s.io/initial-events-end": "true"},
        }
    finally:
        resp.release()
    with pytest.raises(ApiException) as err:
        await v1.list_namespaced_pod(NS, watch=True, send_initial_events=True)
    assert err.value.status == 422


def test_history_is_bounded() -> None:
    with FakeKube(history_limit=3) as fake:
        first = fake.create(pod("a"))["metadata"]["resourceVersion"]
        for n in range(3):
            fake.patch("v1", "Pod", NS, "a", {"metadata": {"labels": {"n": str(n)}}})
        evicted = int(first)  # the history holds the 3 patches, not the create
        assert fake.list("v1", "Pod", NS)[0]["metadata"]["labels"] == {"n": "2"}

        async def first_event(rv: int) -> dict[str, Any]:
            cfg = client.Configuration(host=fake.url, api_key={"BearerToken": f"Bearer {fake.token}"})
            async with client.ApiClient(cfg) as api:
                resp = await raw(
                    client.CoreV1Api(api).list_namespaced_pod, NS, watch=True, resource_version=str(rv)
                )
                try:
                    return await next_event(resp)
                finally:
                    resp.release()

        assert asyncio.run(first_event(evicted - 1))["type"] == "ERROR"  # would need the evicted create
        replayed = asyncio.run(first_event(evicted))
        assert replayed["type"] == "MODIFIED" and replayed["object"]["metadata"]["labels"] == {"n": "0"}


async def test_watch_from_compacted_resource_version_gets_410_error_event(
    fake: FakeKube, api: client.ApiClient
) -> None:
    rv = fake.create(pod("a"))["metadata"]["resourceVersion"]
    fake.patch("v1", "Pod", NS, "a", {"metadata": {"labels": {"v": "2"}}})
    fake.compact()
    v1 = client.CoreV1Api(api)
    resp = await raw(v1.list_namespaced_pod, NS, watch=True, resource_version=rv)
    try:
        assert resp.status == 200
        error = await next_event(resp)
        assert error["type"] == "ERROR"
        assert error["object"]["kind"] == "Status"
        assert (error["object"]["code"], error["object"]["reason"]) == (410, "Expired")
        assert await resp.content.readline() == b""
    finally:
        resp.release()
    with pytest.raises(ApiException) as err:
        async with watch.Watch() as w:
            async for _ in w.stream(v1.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=2):
                pass
    assert err.value.status == 410
    current = await raw(v1.list_namespaced_pod, NS, watch=True, resource_version=fake.resource_version)
    try:
        fake.create(pod("b"))  # the current resourceVersion is still fine
        assert (await next_event(current))["object"]["metadata"]["name"] == "b"
    finally:
        current.release()


async def test_drop_watches_breaks_the_connection(fake: FakeKube, api: client.ApiClient) -> None:
    fake.create(pod("a"))
    v1 = client.CoreV1Api(api)
    resp = await raw(v1.list_namespaced_pod, NS, watch=True)
    try:
        await next_event(resp)
        assert fake.drop_watches() == 1
        assert fake.open_watches() == 0
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(resp.content.readline(), 5)
    finally:
        resp.release()

    with pytest.raises(aiohttp.ClientPayloadError):
        async with watch.Watch() as w:
            async for _ in w.stream(v1.list_namespaced_pod, NS):
                assert fake.drop_watches() == 1
    resp = await raw(v1.list_namespaced_pod, NS, watch=True)  # the server still serves
    try:
        assert (await next_event(resp))["type"] == "ADDED"
    finally:
        resp.release()


async def test_filtered_watch_sees_selector_transitions(fake: FakeKube, api: client.ApiClient) -> None:
    fake.create(pod("a", role="prefill"))
    resp = await raw(client.CoreV1Api(api).list_namespaced_pod, NS, watch=True, label_selector="role=decode")

    def relabel(**labels: str) -> None:
        fake.patch("v1", "Pod", NS, "a", {"metadata": {"labels": labels}})

    try:
        await fake.wait_for_async(lambda: fake.open_watches() == 1)
        relabel(role="decode")
        event = await next_event(resp)
        assert event["type"] == "ADDED" and event["object"]["metadata"]["labels"] == {"role": "decode"}
        relabel(role="decode", zone="a")
        event = await next_event(resp)
        assert event["type"] == "MODIFIED" and event["object"]["metadata"]["labels"]["zone"] == "a"
        relabel(role="prefill")
        event = await next_event(resp)
        assert event["type"] == "DELETED"
        assert event["object"]["metadata"]["labels"]["role"] == "prefill"  # the new state
        assert event["object"]["metadata"]["resourceVersion"] == fake.resource_version
        relabel(zone="b")  # still not selected: nothing sent
        fake.delete("v1", "Pod", NS, "a")  # not selected: nothing sent
        fake.create(pod("b", role="decode"))
        event = await next_event(resp)
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "b")
    finally:
        resp.release()


async def test_field_selector_and_namespace_scope_on_watches(fake: FakeKube, api: client.ApiClient) -> None:
    v1 = client.CoreV1Api(api)
    all_ns = await raw(v1.list_pod_for_all_namespaces, watch=True)
    by_name = await raw(v1.list_namespaced_pod, NS, watch=True, field_selector="metadata.name=b")
    try:
        await fake.wait_for_async(lambda: fake.open_watches("Pod") == 2)
        fake.create(pod("a", namespace="other"))
        fake.create(pod("b", namespace="other"))
        fake.create(pod("b"))
        assert [(await next_event(all_ns))["object"]["metadata"]["namespace"] for _ in range(3)] == [
            "other",
            "other",
            "default",
        ]
        event = await next_event(by_name)
        assert (event["object"]["metadata"]["namespace"], event["object"]["metadata"]["name"]) == (NS, "b")
    finally:
        all_ns.release()
        by_name.release()


async def test_timeout_seconds_ends_the_stream_cleanly(fake: FakeKube, api: client.ApiClient) -> None:
    resp = await raw(client.CoreV1Api(api).list_namespaced_pod, NS, watch=True, timeout_seconds=1)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await asyncio.wait_for(resp.content.readline(), 5) == b""
        assert 0.8 < loop.time() - started < 3
    finally:
        resp.release()


# ------------------------------------------------------------------------------------------ custom objects


async def test_inference_pool_list_get_and_watch(fake: FakeKube, api: client.ApiClient) -> None:
    fake.create(pool("p1"))
    custom = client.CustomObjectsApi(api)
    listed = await custom.list_namespaced_custom_object(POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL)
    assert listed["kind"] == "InferencePoolList" and listed["apiVersion"] == POOL_API
    assert [i["metadata"]["name"] for i in listed["items"]] == ["p1"]
    got = await custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL, "p1")
    assert got["spec"]["targetPorts"] == [{"number": 8000}]
    with pytest.raises(ApiException) as err:
        await custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL, "nope")
    assert err.value.status == 404
    assert status_of(err.value)["reason"] == "NotFound"

    seen: list[tuple[str, str]] = []
    async with watch.Watch() as w:
        stream = w.stream(
            custom.list_namespaced_custom_object, POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL, timeout_seconds=5
        )
        async for event in stream:
            seen.append((event["type"], event["object"]["metadata"]["name"]))
            if len(seen) == 1:
                fake.apply(pool("p1", selector={"matchLabels": {"app": "x"}}, targetPorts=[{"number": 1}]))
            else:
                w.stop()
                break
    assert seen == [("ADDED", "p1"), ("MODIFIED", "p1")]
    assert w.resource_version == fake.resource_version


async def test_custom_object_writes(fake: FakeKube, api: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api)
    args = (POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL)
    created = await custom.create_namespaced_custom_object(*args, pool("p"))
    assert created["metadata"]["generation"] == 1
    with pytest.raises(ApiException) as json_patch_of_a_dict:
        # The client sends a dict as application/json-patch+json; a real API server rejects that too.
        await custom.patch_namespaced_custom_object(*args, "p", {"metadata": {"labels": {"a": "b"}}})
    assert json_patch_of_a_dict.value.status == 400
    merged = await cast(Any, custom).patch_namespaced_custom_object(
        *args, "p", {"metadata": {"labels": {"a": "b"}}}, _content_type="application/merge-patch+json"
    )
    assert merged["metadata"]["labels"] == {"a": "b"}
    patched = await custom.patch_namespaced_custom_object(
        *args, "p", [{"op": "replace", "path": "/spec/targetPorts/0/number", "value": 9000}]
    )
    assert patched["spec"]["targetPorts"] == [{"number": 9000}] and patched["metadata"]["generation"] == 2

    with_status = await custom.replace_namespaced_custom_object_status(
        *args, "p", {**patched, "status": {"parents": []}, "spec": {"ignored": True}}
    )
    assert with_status["status"] == {"parents": []} and with_status["spec"] == patched["spec"]
    replaced = await custom.replace_namespaced_custom_object(*args, "p", {**with_status, "status": {"x": 1}})
    assert replaced["status"] == {"parents": []}  # the main resource does not write status
    unversioned = {
        **replaced,
        "metadata": {k: v for k, v in replaced["metadata"].items() if k != "resourceVersion"},
    }
    with pytest.raises(ApiException) as missing_rv:
        await custom.replace_namespaced_custom_object(*args, "p", unversioned)
    assert missing_rv.value.status == 422

    deleted = await custom.delete_namespaced_custom_object(*args, "p")
    assert deleted["metadata"]["name"] == "p"
    assert fake.get(POOL_API, "InferencePool", NS, "p") is None


@pytest.mark.parametrize("group", ["llm-d.ai", "inference.networking.x-k8s.io"])
async def test_objective_and_rewrite_kinds_are_served(
    fake: FakeKube, api: client.ApiClient, group: str
) -> None:
    version = "v1alpha2"
    fake.create(
        {
            "apiVersion": f"{group}/{version}",
            "kind": "InferenceObjective",
            "metadata": {"name": "o"},
            "spec": {"priority": 1},
        }
    )
    fake.create(
        {
            "apiVersion": f"{group}/{version}",
            "kind": "InferenceModelRewrite",
            "metadata": {"name": "r"},
            "spec": {},
        }
    )
    custom = client.CustomObjectsApi(api)
    objectives = await custom.list_namespaced_custom_object(group, version, NS, "inferenceobjectives")
    rewrites = await custom.list_custom_object_for_all_namespaces(group, version, "inferencemodelrewrites")
    assert objectives["kind"] == "InferenceObjectiveList" and objectives["items"][0]["spec"] == {
        "priority": 1
    }
    assert [i["kind"] for i in rewrites["items"]] == ["InferenceModelRewrite"]


# ------------------------------------------------------------------------------------------ leases


async def test_lease_optimistic_concurrency(fake: FakeKube, api: client.ApiClient) -> None:
    leases = client.CoordinationV1Api(api)
    body = client.V1Lease(
        metadata=client.V1ObjectMeta(name="epp-leader"),
        spec=client.V1LeaseSpec(holder_identity="pod-1", lease_duration_seconds=15),
    )
    created = await leases.create_namespaced_lease(NS, body)
    assert created.spec.holder_identity == "pod-1"
    with pytest.raises(ApiException) as exists:
        await leases.create_namespaced_lease(NS, body)
    assert exists.value.status == 409 and status_of(exists.value)["reason"] == "AlreadyExists"

    current = await leases.read_namespaced_lease("epp-leader", NS)
    stale_rv = current.metadata.resource_version
    current.spec.holder_identity = "pod-2"
    taken = await leases.replace_namespaced_lease("epp-leader", NS, current)
    assert taken.spec.holder_identity == "pod-2"
    assert int(taken.metadata.resource_version) > int(stale_rv)

    current.spec.holder_identity = "pod-3"  # still carries the old resourceVersion
    with pytest.raises(ApiException) as conflict:
        await leases.replace_namespaced_lease("epp-leader", NS, current)
    assert conflict.value.status == 409 and status_of(conflict.value)["reason"] == "Conflict"
    assert fake.get("coordination.k8s.io/v1", "Lease", NS, "epp-leader")["spec"]["holderIdentity"] == "pod-2"  # type: ignore[index]

    renewed = await leases.patch_namespaced_lease("epp-leader", NS, {"spec": {"leaseTransitions": 1}})
    assert renewed.spec.lease_transitions == 1 and renewed.spec.holder_identity == "pod-2"
    unchanged = await leases.replace_namespaced_lease("epp-leader", NS, renewed)
    assert unchanged.metadata.resource_version == renewed.metadata.resource_version  # a no-op update
    done = await leases.delete_namespaced_lease("epp-leader", NS)
    assert done.status == "Success"
    with pytest.raises(ApiException) as gone:
        await leases.read_namespaced_lease("epp-leader", NS)
    assert gone.value.status == 404


# ------------------------------------------------------------------------------------------ server behaviour


async def test_requests_need_the_bearer_token(fake: FakeKube) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{fake.url}/api/v1/namespaces/default/pods") as resp:
            assert resp.status == 401
            assert (await resp.json())["reason"] == "Unauthorized"
        headers = {"Authorization": f"Bearer {fake.token}"}
        async with session.get(f"{fake.url}/api/v1/namespaces/default/pods", headers=headers) as resp:
            assert resp.status == 200
    wrong = client.Configuration(host=fake.url, api_key={"BearerToken": "Bearer other-token"})
    async with client.ApiClient(wrong) as api:
        with pytest.raises(ApiException) as err:
            await client.CoreV1Api(api).list_namespaced_pod(NS)
    assert err.value.status == 401
    assert ("GET", "/api/v1/namespaces/default/pods", {}) in fake.requests


async def test_discovery_and_uninstalled_groups(fake: FakeKube, api: client.ApiClient) -> None:
    version = await client.VersionApi(api).get_code()
    assert version.major == "1" and version.git_version.startswith("v1.")
    assert (await client.CoreApi(api).get_api_versions()).versions == ["v1"]
    groups = {g.name for g in (await client.ApisApi(api).get_api_versions()).groups}
    assert {POOL_GROUP, "inference.networking.x-k8s.io", "llm-d.ai", "coordination.k8s.io"} <= groups
    resources = await client.CoordinationV1Api(api).get_api_resources()
    assert [(r.name, r.kind, r.namespaced) for r in resources.resources] == [("leases", "Lease", True)]
    pools = await client.CustomObjectsApi(api).get_api_resources(POOL_GROUP, POOL_VERSION)
    assert {r.name for r in pools.resources} == {"inferencepools", "inferencepools/status"}

    fake.create(pool("p"))
    custom = client.CustomObjectsApi(api)
    resp = await raw(
        custom.list_namespaced_custom_object, POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL, watch=True
    )
    try:
        await next_event(resp)
        fake.set_group_installed(POOL_GROUP, False)
        assert await asyncio.wait_for(resp.content.readline(), 5) == b""  # open watches end
    finally:
        resp.release()
    with pytest.raises(ApiException) as err:
        await custom.list_namespaced_custom_object(POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL)
    assert err.value.status == 404 and status_of(err.value)["reason"] == "NotFound"
    with pytest.raises(ApiException) as discovery:
        await custom.get_api_resources(POOL_GROUP, POOL_VERSION)
    assert discovery.value.status == 404
    groups = {g.name for g in (await client.ApisApi(api).get_api_versions()).groups}
    assert POOL_GROUP not in groups and "coordination.k8s.io" in groups

    fake.set_group_installed(POOL_GROUP, True)
    listed = await custom.list_namespaced_custom_object(POOL_GROUP, POOL_VERSION, NS, POOL_PLURAL)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["p"]


async def test_fail_next_injects_error_statuses(fake: FakeKube, api: client.ApiClient) -> None:
    v1 = client.CoreV1Api(api)
    fake.fail_next("GET", "/pods", status=500, count=2)
    fake.fail_next("get", "watch=", status=429)
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            await v1.list_namespaced_pod(NS)
        assert err.value.status == 500 and status_of(err.value)["reason"] == "InternalError"
    assert (await v1.list_namespaced_pod(NS)).items == []
    with pytest.raises(ApiException) as throttled:
        await v1.list_namespaced_pod(NS, watch=True)
    assert throttled.value.status == 429
    assert throttled.value.headers is not None and throttled.value.headers["Retry-After"] == "1"
    assert len([r for r in fake.requests if r[1] == "/api/v1/namespaces/default/pods"]) == 4


async def test_tls_with_in_cluster_config(tmp_path: Path) -> None:
    with FakeKube(tls=True) as fake:
        assert fake.url.startswith("https://127.0.0.1:")
        fake.create(pod("a"))
        token_file, ca_file = fake.write_incluster_files(tmp_path / "sa")
        cfg = client.Configuration()
        InClusterConfigLoader(
            token_filename=str(token_file),
            cert_filename=str(ca_file),
            environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(fake.port)},
        ).load_and_set(cfg)
        async with client.ApiClient(cfg) as api:
            v1 = client.CoreV1Api(api)
            assert [p.metadata.name for p in (await v1.list_namespaced_pod(NS)).items] == ["a"]
            resp = await raw(v1.list_namespaced_pod, NS, watch=True)
            try:
                assert (await next_event(resp))["type"] == "ADDED"
                assert fake.drop_watches() == 1
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(resp.content.readline(), 5)
            finally:
                resp.release()
        async with await client_for(fake, tmp_path) as api:  # kubeconfig with certificate-authority-data
            assert len((await client.CoreV1Api(api).list_namespaced_pod(NS)).items) == 1
        untrusted = client.Configuration(host=fake.url)
        async with client.ApiClient(untrusted) as api:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await client.CoreV1Api(api).list_namespaced_pod(NS)
    with pytest.raises(RuntimeError):
        FakeKube().write_incluster_files(tmp_path)
