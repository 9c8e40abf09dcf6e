"""One EPP serving several pools behind one Envoy (file discovery, an endpoints file grouped by pool).

Envoy's bootstrap (``envoy_bootstrap(pools=...)``) has a virtual host per pool whose routes name the
pool to the EPP in the ext_proc stream's gRPC metadata.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp.dev.stack.files import write_atomic
from epp.dev.stack.redis_server import RedisServer
from epp.framework.wire import POOL_LABEL
from tests.integration.harness import SUBSET_HEADER, Envoy, Rig, Sim, chat_body, marker
from tests.redis_fixture import redis_server as redis_server

pytestmark = pytest.mark.integration

POOLS = ("pool-a", "pool-b", "pool-c")


def _write_pools(path: Path, pools: Mapping[str, Sequence[Sim]]) -> None:
    document = {
        "pools": [
            {
                "name": name,
                "endpoints": [{"name": s.name, "address": "127.0.0.1", "port": s.port} for s in sims],
            }
            for name, sims in pools.items()
        ]
    }
    write_atomic(path, yaml.safe_dump(document, sort_keys=False))


def _post(envoy: Envoy, pool: str, headers: Mapping[str, str] | None = None) -> tuple[int, int | None, str]:
    m = marker()
    resp = envoy.post("/v1/chat/completions", chat_body(m), {"Host": pool, **(headers or {})})
    return resp.status, resp.port, resp.body.decode(errors="replace")


def _wait_serving(envoy: Envoy, pool: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = _post(envoy, pool)
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{pool} not serving: {status} {body}")
        time.sleep(0.1)


@pytest.mark.parametrize("server", ["epp", "grpcio"])
def test_three_pools_behind_one_envoy(rig: Rig, server: str) -> None:
    """Also on the grpcio ext_proc server: both give the route's metadata to the pool choice."""
    sims = rig.start_sims(7)
    members = {"pool-a": sims[0:2], "pool-b": sims[2:4], "pool-c": sims[4:6]}
    epp = rig.start_epp([], extra=["--extproc-server", server])
    _write_pools(epp.endpoints_file, members)
    envoy = rig.start_envoy(
        epp, pools=[*POOLS, "pool-z"], subset_hint_header=SUBSET_HEADER, wait_for_traffic=False
    )
    for pool in POOLS:
        _wait_serving(envoy, pool)

    # every request lands in its own pool, whatever pool header the client sends
    for pool, own in members.items():
        ports = {s.port for s in own}
        seen: set[int | None] = set()
        for i in range(12):
            other = POOLS[(POOLS.index(pool) + 1 + i) % 3]
            status, port, body = _post(envoy, pool, {"x-epp-pool": other} if i % 2 else None)
            assert status == 200, body
            assert port in ports, (pool, port)
            seen.add(port)
        assert seen == ports  # both of the pool's endpoints serve
    for sim in sims[:6]:  # the client's pool header never reaches an engine
        assert all("x-epp-pool" not in entry["headers"] for entry in sim.journal())

    # a route naming a pool the EPP does not serve: 404 naming it
    status, _, body = _post(envoy, "pool-z")
    assert status == 404, body
    assert "pool-z" in body
    # no route metadata: the subset hint's endpoints pick the pool
    target = sims[3]
    resp = envoy.post("/v1/chat/completions", chat_body(marker()), {SUBSET_HEADER: target.address})
    assert resp.status == 200, resp
    assert resp.port == target.port
    # no route metadata, no hint: 404, nothing routed
    resp = envoy.post("/v1/chat/completions", chat_body(marker()))
    assert resp.status == 404, resp
    assert "x-epp-pool" in resp.body.decode()
    assert sims[6].journal() == []
    page = epp.metrics()
    for pool in POOLS:
        assert f'llm_d_epp_pool_request_total{{inference_pool="{pool}"}}' in page
    assert 'llm_d_epp_pool_request_error_total{error_code="NotFound",inference_pool=""}' in page or (
        'llm_d_epp_pool_request_error_total{inference_pool="",error_code="NotFound"}' in page
    )

    # a pool added to the file serves; a pool removed stops
    _write_pools(epp.endpoints_file, {**members, "pool-z": [sims[6]]})
    _wait_serving(envoy, "pool-z")
    status, port, _ = _post(envoy, "pool-z")
    assert (status, port) == (200, sims[6].port)
    del members["pool-c"]
    _write_pools(epp.endpoints_file, {**members, "pool-z": [sims[6]]})
    deadline = time.monotonic() + 20
    while (reply := _post(envoy, "pool-c"))[0] != 404:
        assert time.monotonic() < deadline, "pool-c still served after its removal"
        time.sleep(0.1)
    assert "no InferencePool 'pool-c'" in reply[2], reply  # the 404 names the pool
    status, port, _ = _post(envoy, "pool-a")
    assert status == 200 and port in {sims[0].port, sims[1].port}

    # a pool's endpoints change: sims[1] moves from pool-a to pool-b
    _write_pools(epp.endpoints_file, {"pool-a": sims[0:1], "pool-b": sims[1:4], "pool-z": [sims[6]]})
    deadline = time.monotonic() + 20
    while {_post(envoy, "pool-a")[1] for _ in range(6)} != {sims[0].port}:
        assert time.monotonic() < deadline, "sims[1] still serves pool-a after it moved"
        time.sleep(0.1)
    seen = set()
    for _ in range(24):
        status, port, body = _post(envoy, "pool-b")
        assert status == 200, body
        seen.add(port)
    assert seen <= {sims[1].port, sims[2].port, sims[3].port} and sims[1].port in seen


def test_one_pool_faults_do_not_reach_another(rig: Rig) -> None:
    """Pool b's endpoints are all dead (metrics failing, connections refused): pool a serves on."""
    sims = rig.start_sims(2)
    epp = rig.start_epp([])
    dead = [Sim(f"dead-{i}", port, sims[0].child, "127.0.0.1") for i, port in enumerate((1, 2))]
    _write_pools(epp.endpoints_file, {"pool-a": sims, "pool-b": dead})
    envoy = rig.start_envoy(epp, pools=["pool-a", "pool-b"], wait_for_traffic=False)
    _wait_serving(envoy, "pool-a")
    ports = {s.port for s in sims}
    for _ in range(20):
        status, port, body = _post(envoy, "pool-a")
        assert status == 200, body
        assert port in ports
        status, _, _ = _post(envoy, "pool-b")
        assert status != 200


def test_three_inferencepools_from_the_api_server(rig: Rig, tmp_path: Path) -> None:
    """``--pool-selector``: pools labelled for this EPP are served; one created at run time starts
    serving, one deleted stops."""
    from epp.dev import stack
    from tests.fakekube import FakeKube, objects

    ns = "inference"
    hosts = [f"127.0.0.{21 + i}" for i in range(5)]
    port = stack.free_port()
    sims = rig.start_sims(5, prefix="pod", hosts=hosts, port=port)
    owner = {"pool-a": sims[0:2], "pool-b": sims[2:3], "pool-c": sims[3:4]}

    def pool(name: str) -> dict[str, object]:
        obj = objects.inference_pool(ns, (port,), name=name, selector={"app": name})
        obj["metadata"]["labels"] = {"epp": "shared"}  # type: ignore[index]
        return obj

    with FakeKube(bookmark_interval=0.5) as kube:
        for name in ("pool-a", "pool-b"):
            kube.create(pool(name))
        for name, members in owner.items():
            for sim in members:
                kube.create(objects.pod(ns, sim.name, sim.host, labels={"app": name}))
        kube.create(objects.pod(ns, sims[4].name, sims[4].host, labels={"app": "pool-a-next"}))
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")
        args = ["--pool-namespace", ns, "--kubeconfig", str(config), "--pool-selector", "epp=shared"]
        epp = rig.start_epp([], file_discovery=False, extra=args)
        envoy = rig.start_envoy(epp, pools=list(owner), wait_for_traffic=False)
        for name in ("pool-a", "pool-b"):
            _wait_serving(envoy, name)
            for _ in range(8):
                m = marker()
                resp = envoy.post(
                    "/v1/chat/completions", chat_body(m), {"Host": name, "x-epp-pool": "pool-c"}
                )
                assert resp.status == 200, resp
                assert resp.headers["x-inference-pod"] in {s.name for s in owner[name]}, name
        assert _post(envoy, "pool-c")[0] == 404  # not created yet

        kube.create(pool("pool-c"))  # appears at run time
        _wait_serving(envoy, "pool-c")
        resp = envoy.post("/v1/chat/completions", chat_body(marker()), {"Host": "pool-c"})
        assert resp.headers["x-inference-pod"] == sims[3].name

        # changed: pool-a's selector now picks another pod; its own pods leave it
        selector = {"spec": {"selector": {"matchLabels": {"app": "pool-a-next"}}}}
        kube.patch(objects.POOL_API, "InferencePool", ns, "pool-a", selector)
        deadline = time.monotonic() + 20
        while True:
            resp = envoy.post("/v1/chat/completions", chat_body(marker()), {"Host": "pool-a"})
            if resp.status == 200 and resp.headers["x-inference-pod"] == sims[4].name:
                break
            assert time.monotonic() < deadline, "pool-a's selector change not followed"
            time.sleep(0.1)
        for _ in range(6):
            resp = envoy.post("/v1/chat/completions", chat_body(marker()), {"Host": "pool-a"})
            assert (resp.status, resp.headers["x-inference-pod"]) == (200, sims[4].name)

        kube.delete(objects.POOL_API, "InferencePool", ns, "pool-b")  # deleted: no longer served
        deadline = time.monotonic() + 20
        while (reply := _post(envoy, "pool-b"))[0] != 404:
            assert time.monotonic() < deadline, "pool-b still served after its deletion"
            time.sleep(0.1)
        assert "no InferencePool 'pool-b'" in reply[2], reply  # the 404 names the pool
        assert _post(envoy, "pool-c")[0] == 200
        assert stack.grpc_serving(epp.health_port)  # ready: every selected pool synced once


def _queued(epp: Any) -> float:
    total = 0.0
    for line in epp.metrics().splitlines():
        if line.startswith("llm_d_epp_flow_control_queue_size"):
            total += float(line.rpartition(" ")[2])
    return total


def test_one_pools_full_flow_control_queue_does_not_reach_another(rig: Rig) -> None:
    """Flow control gated by one in-flight request per pool, one queued request at most: pool b is
    saturated and its queue full (429), while pool a's requests are served at once."""
    (slow,) = rig.start_sims(1, extra=["--inter-token-latency", "200", "--max-tokens", "20"])  # ~4 s
    fast = rig.start_sims(2)
    config = {
        "featureGates": ["flowControl"],
        "plugins": [
            {"name": "gate", "type": "concurrency-detector", "parameters": {"maxConcurrency": 1}},
            {"name": "fair", "type": "round-robin-fairness-policy"},
        ],
        "flowControl": {
            "saturationDetector": {"pluginRef": "gate"},
            "defaultPriorityBand": {"fairnessPolicyRef": "fair"},
            "maxRequests": 1,
        },
    }
    # the pools exist from the start (an endpoints file labelled by pool): no request meets the
    # first pool, empty, whose flow control would hold it
    labels = {s.name: {POOL_LABEL: "pool-a"} for s in fast} | {slow.name: {POOL_LABEL: "pool-b"}}
    epp = rig.start_epp([*fast, slow], config=config, labels=labels)
    envoy = rig.start_envoy(epp, pools=["pool-a", "pool-b"], wait_for_traffic=False)
    _wait_serving(envoy, "pool-a")
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        in_flight = threads.submit(_post, envoy, "pool-b")
        deadline = time.monotonic() + 20
        while not slow.journal():
            assert time.monotonic() < deadline, "pool-b's first request never reached its engine"
            time.sleep(0.02)
        waiting = threads.submit(_post, envoy, "pool-b")
        while _queued(epp) < 1:
            assert time.monotonic() < deadline, "pool-b's second request never queued"
            time.sleep(0.02)
        assert _post(envoy, "pool-b")[0] == 429  # pool-b's queue is full
        ports = {s.port for s in fast}
        for _ in range(10):
            status, port, body = _post(envoy, "pool-a")
            assert status == 200, body
            assert port in ports
        assert not in_flight.done()  # pool a was served while pool b's request still ran
        assert in_flight.result(timeout=30)[0] == 200
        assert waiting.result(timeout=30)[0] == 200


def test_inferencepools_of_every_namespace(rig: Rig, tmp_path: Path) -> None:
    """``--pool-namespace ''``: labelled pools of any namespace are served, named NAMESPACE/NAME; a
    request goes to the pool its subset hint's endpoints belong to."""
    from epp.dev import stack
    from tests.fakekube import FakeKube, objects

    port = stack.free_port()
    sims = rig.start_sims(2, prefix="pod", hosts=["127.0.0.31", "127.0.0.32"], port=port)
    with FakeKube(bookmark_interval=0.5) as kube:
        for ns, sim in zip(("team-a", "team-b"), sims, strict=True):
            pool = objects.inference_pool(ns, (port,), name="chat", selector={"app": "chat"})
            pool["metadata"]["labels"] = {"epp": "shared"}
            kube.create(pool)
            kube.create(objects.pod(ns, sim.name, sim.host, labels={"app": "chat"}))
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")
        args = ["--pool-namespace", "", "--kubeconfig", str(config), "--pool-selector", "epp=shared"]
        epp = rig.start_epp([], file_discovery=False, extra=args)
        envoy = rig.start_envoy(
            epp, pools=["team-a/chat"], subset_hint_header=SUBSET_HEADER, wait_for_traffic=False
        )
        for sim in sims:
            deadline = time.monotonic() + 20
            while True:
                resp = envoy.post("/v1/chat/completions", chat_body(marker()), {SUBSET_HEADER: sim.address})
                if resp.status == 200:
                    break
                assert time.monotonic() < deadline, (resp.status, resp.body[:300])
                time.sleep(0.1)
            assert resp.headers["x-inference-pod"] == sim.name
        resp = envoy.post("/v1/chat/completions", chat_body(marker()))
        assert resp.status == 404
        assert "team-a/chat" in resp.body.decode() and "team-b/chat" in resp.body.decode()


def test_hanging_endpoint_and_failing_discovery_of_one_pool_do_not_reach_another(
    rig: Rig, tmp_path: Path
) -> None:
    """Pool b has an endpoint that accepts connections and never answers (its /metrics hang), then
    its discovery fails (every API request about pool b answers 500, the watches drop): pool a's
    requests are served throughout, and a pool created meanwhile starts serving."""
    import socket

    from epp.dev import stack
    from tests.fakekube import FakeKube, objects

    ns = "inference"
    port = stack.free_port()
    sims = rig.start_sims(3, prefix="pod", hosts=["127.0.0.41", "127.0.0.42", "127.0.0.43"], port=port)
    hanging = socket.socket()
    hanging.bind(("127.0.0.44", port))
    hanging.listen(1024)  # never accepted: connections open, requests are never answered

    def pool(name: str) -> dict[str, object]:
        obj = objects.inference_pool(ns, (port,), name=name, selector={"app": name})
        obj["metadata"]["labels"] = {"epp": "shared"}
        return obj

    def served(name: str) -> set[str]:
        pods = set()
        for _ in range(8):
            t0 = time.monotonic()
            resp = envoy.post("/v1/chat/completions", chat_body(marker()), {"Host": name})
            # a generous safety bound: pool b's scrapes hang for seconds at a time
            assert time.monotonic() - t0 < 5.0, "pool-a's request waited on pool-b"
            assert resp.status == 200, resp
            pods.add(resp.headers["x-inference-pod"])
        return pods

    try:
        with FakeKube(bookmark_interval=0.5) as kube:
            for name in ("pool-a", "pool-b"):
                kube.create(pool(name))
            kube.create(objects.pod(ns, sims[0].name, sims[0].host, labels={"app": "pool-a"}))
            kube.create(objects.pod(ns, sims[1].name, sims[1].host, labels={"app": "pool-a"}))
            kube.create(objects.pod(ns, "hang", "127.0.0.44", labels={"app": "pool-b"}))
            kube.create(objects.pod(ns, sims[2].name, sims[2].host, labels={"app": "pool-c"}))
            config = kube.write_kubeconfig(tmp_path / "kubeconfig")
            args = ["--pool-namespace", ns, "--kubeconfig", str(config), "--pool-selector", "epp=shared"]
            epp = rig.start_epp(
                [], file_discovery=False, extra=[*args, "--metrics-staleness-threshold", "3s"]
            )
            envoy = rig.start_envoy(epp, pools=["pool-a", "pool-b", "pool-c"], wait_for_traffic=False)
            _wait_serving(envoy, "pool-a")
            own = {sims[0].name, sims[1].name}
            assert served("pool-a") <= own

            kube.fail_next("*", "pool-b", 500, count=100_000)  # pool b's discovery errors from now on
            mark = len(kube.requests)
            kube.drop_watches()
            kube.create(pool("pool-c"))  # another pool still appears while pool b's discovery fails
            _wait_serving(envoy, "pool-c")
            for _ in range(3):
                assert served("pool-a") <= own
                assert served("pool-c") == {sims[2].name}
            # pool b's discovery did ask again meanwhile (and was answered 500)
            asked = [(p, q) for _, p, q in kube.requests[mark:] if "pool-b" in p or "pool-b" in str(q)]
            assert asked, "pool-b's discovery never asked the API server again"
    finally:
        hanging.close()


def test_a_pool_with_its_own_config(rig: Rig, tmp_path: Path) -> None:
    """``epp.llm-d.ai/config-map`` names a ConfigMap whose config is that pool's own: here a filter
    keeping only the pool's ``canary`` pod, while the other pool (shared config) uses both of its
    pods; a ConfigMap that does not exist leaves its pool unserved (404), the others served."""
    from epp.dev import stack
    from tests.fakekube import FakeKube, objects

    ns = "inference"
    port = stack.free_port()
    sims = rig.start_sims(4, prefix="pod", hosts=[f"127.0.0.{51 + i}" for i in range(4)], port=port)
    own = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {
                "name": "canary",
                "type": "label-selector-filter",
                "parameters": {"matchLabels": {"track": "canary"}},
            },
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {"type": "single-profile-handler"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "canary"},
                    {"pluginRef": "queue-scorer"},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }

    def pool(name: str, config_map: str = "") -> dict[str, Any]:
        obj = objects.inference_pool(ns, (port,), name=name, selector={"app": name})
        obj["metadata"]["labels"] = {"epp": "shared"}
        if config_map:
            obj["metadata"]["annotations"] = {"epp.llm-d.ai/config-map": config_map}
        return obj

    with FakeKube(bookmark_interval=0.5) as kube:
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "pool-b-config", "namespace": ns},
                "data": {"epp.yaml": yaml.safe_dump(own)},
            }
        )
        kube.create(pool("pool-a"))
        kube.create(pool("pool-b", "pool-b-config/epp.yaml"))
        kube.create(pool("pool-c", "no-such-config"))
        for sim, app in zip(sims, ("pool-a", "pool-a", "pool-b", "pool-b"), strict=True):
            labels = {"app": app, **({"track": "canary"} if sim is sims[3] else {})}
            kube.create(objects.pod(ns, sim.name, sim.host, labels=labels))
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")
        args = ["--pool-namespace", ns, "--kubeconfig", str(config), "--pool-selector", "epp=shared"]
        epp = rig.start_epp([], file_discovery=False, extra=args, wait_ready=False)
        envoy = rig.start_envoy(epp, pools=["pool-a", "pool-b", "pool-c"], wait_for_traffic=False)
        _wait_serving(envoy, "pool-a")
        _wait_serving(envoy, "pool-b")
        seen: dict[str, set[str]] = {"pool-a": set(), "pool-b": set()}
        for _ in range(16):
            for name, pods in seen.items():
                resp = envoy.post("/v1/chat/completions", chat_body(marker()), {"Host": name})
                assert resp.status == 200, resp
                pods.add(resp.headers["x-inference-pod"])
        assert seen["pool-a"] == {sims[0].name, sims[1].name}  # the shared config: no filter
        assert seen["pool-b"] == {sims[3].name}  # its own config: the canary only
        status, _, body = _post(envoy, "pool-c")
        assert status == 404 and "pool-c" in body, body


def test_config_reload_reaches_every_pool(rig: Rig) -> None:
    """``--watch-config-file``: a filter's parameters edited live change the routing of every pool,
    not only the first's."""
    sims = rig.start_sims(4)
    config = yaml.safe_load(
        """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- {name: group, type: label-selector-filter, parameters: {matchLabels: {group: a}}}
- {type: queue-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: group}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""
    )
    pools = {"pool-a": sims[0:2], "pool-b": sims[2:4]}
    labels = {
        sim.name: {POOL_LABEL: pool, "group": "ab"[i]}
        for pool, members in pools.items()
        for i, sim in enumerate(members)
    }
    path = rig.log_dir / "epp-config.yaml"
    epp = rig.start_epp(sims, config=config, labels=labels, extra=["--watch-config-file"], config_file=path)
    envoy = rig.start_envoy(epp, pools=list(pools), wait_for_traffic=False)

    def ports(pool: str) -> set[int | None]:
        seen = set()
        for _ in range(8):
            status, port, body = _post(envoy, pool)
            assert status == 200, body
            seen.add(port)
        return seen

    for pool in pools:
        _wait_serving(envoy, pool)
    assert ports("pool-a") == {sims[0].port}
    assert ports("pool-b") == {sims[2].port}

    edited = yaml.safe_load(path.read_text())
    edited["plugins"][1]["parameters"]["matchLabels"] = {"group": "b"}  # [0] is file-discovery
    write_atomic(path, yaml.safe_dump(edited, sort_keys=False))
    deadline = time.monotonic() + 20
    while 'llm_d_epp_config_reloads_total{result="applied"} 1' not in epp.metrics():
        assert time.monotonic() < deadline, "the edit was not applied"
        time.sleep(0.05)
    assert ports("pool-a") == {sims[1].port}
    assert ports("pool-b") == {sims[3].port}  # the second pool reloaded too


def test_objectives_apply_to_the_pools_they_name(rig: Rig, tmp_path: Path) -> None:
    """InferenceObjective with several pools: ``poolRef`` (v1alpha2) names one pool, ``poolRefs[]``
    several, ``poolSelector`` those whose labels match; each pool's requests get the priorities of the
    objectives that apply to it (seen in the engine's body, ``requestHandler.propagatePriority``)."""
    import json

    from epp.dev import stack
    from tests.fakekube import FakeKube, objects

    ns = "inference"
    port = stack.free_port()
    sims = rig.start_sims(2, prefix="pod", hosts=["127.0.0.61", "127.0.0.62"], port=port)
    tiers = {"pool-a": "chat", "pool-b": "batch"}

    def objective(name: str, priority: int, **spec: Any) -> dict[str, Any]:
        obj = objects.objective(ns, name, priority)
        del obj["spec"]["poolRef"]
        obj["spec"].update(spec)
        return obj

    def priority(pool: str, name: str) -> int | None:
        m = marker()
        resp = envoy.post(
            "/v1/chat/completions", chat_body(m), {"Host": pool, "x-gateway-inference-objective": name}
        )
        assert resp.status == 200, resp
        entry = next(e for s in sims if (e := s.find(m)) is not None)
        value = json.loads(entry["body"]).get("priority")
        return int(value) if value is not None else None

    with FakeKube(bookmark_interval=0.5) as kube:
        for (name, tier), sim in zip(tiers.items(), sims, strict=True):
            pool = objects.inference_pool(ns, (port,), name=name, selector={"app": name})
            pool["metadata"]["labels"] = {"epp": "shared", "tier": tier}
            kube.create(pool)
            kube.create(objects.pod(ns, sim.name, sim.host, labels={"app": name}))
        kube.create(objects.objective(ns, "a-only", 3, pool="pool-a"))  # v1alpha2: the pool it names
        kube.create(objective("both", 5, poolRefs=[{"name": "pool-a"}, {"name": "pool-b"}]))
        kube.create(objective("chat", 7, poolSelector={"matchLabels": {"tier": "chat"}}))
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")
        args = ["--pool-namespace", ns, "--kubeconfig", str(config), "--pool-selector", "epp=shared"]
        document = {"apiVersion": "llm-d.ai/v1", "requestHandler": {"propagatePriority": True}}
        epp = rig.start_epp([], file_discovery=False, extra=args, config=document)
        envoy = rig.start_envoy(epp, pools=list(tiers), wait_for_traffic=False)
        for name in tiers:
            _wait_serving(envoy, name)
        deadline = time.monotonic() + 20
        while priority("pool-a", "chat") != 7:  # the objectives arrive through their watch
            assert time.monotonic() < deadline, "the objectives never applied"
            time.sleep(0.2)
        assert priority("pool-a", "a-only") == 3
        assert priority("pool-b", "a-only") == 0  # names pool-a only
        assert priority("pool-a", "both") == 5 and priority("pool-b", "both") == 5
        assert priority("pool-b", "chat") == 0  # pool-b's labels do not match
        # pool-b's labels change: the selector now matches it
        kube.patch(
            objects.POOL_API, "InferencePool", ns, "pool-b", {"metadata": {"labels": {"tier": "chat"}}}
        )
        deadline = time.monotonic() + 20
        while priority("pool-b", "chat") != 7:
            assert time.monotonic() < deadline, "pool-b's new labels were not matched"
            time.sleep(0.2)


def _by_pool(page: str, sample: str, **match: str) -> dict[str, float]:
    """``sample``'s values summed per ``inference_pool`` over the series whose labels match ``match``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in match.items()):
                pool = s.labels["inference_pool"]
                out[pool] = out.get(pool, 0.0) + s.value
    return out


def _total(page: str, sample: str) -> float:
    return sum(
        s.value for family in text_string_to_metric_families(page) for s in family.samples if s.name == sample
    )


def test_request_metrics_carry_each_pools_label(rig: Rig) -> None:
    """Two pools behind one Envoy: each pool's requests, durations and errors count under its own
    ``inference_pool``; a request that matches no pool under ``""``; the reference's deprecated twin
    (no pool label) is their sum."""
    sims = rig.start_sims(3)
    epp = rig.start_epp([])
    _write_pools(epp.endpoints_file, {"pool-a": sims[0:2], "pool-b": sims[2:3]})
    envoy = rig.start_envoy(epp, pools=["pool-a", "pool-b", "pool-z"], wait_for_traffic=False)
    for pool in ("pool-a", "pool-b"):
        _wait_serving(envoy, pool)
    before = epp.metrics()
    sent = {"pool-a": 5, "pool-b": 3}
    for pool, n in sent.items():
        for _ in range(n):
            status, _, body = _post(envoy, pool)
            assert status == 200, body
    bad = envoy.post("/v1/chat/completions", b"{not json", {"Host": "pool-b"})
    assert bad.status == 400, bad
    assert _post(envoy, "pool-z")[0] == 404  # the route names a pool not served here

    def grown(page: str, sample: str, **match: str) -> dict[str, float]:
        now, then = _by_pool(page, sample, **match), _by_pool(before, sample, **match)
        return {p: v - then.get(p, 0.0) for p, v in now.items() if v != then.get(p, 0.0)}

    deadline = time.monotonic() + 10  # the request ends (and its duration counts) as the stream ends
    while grown(page := epp.metrics(), "llm_d_epp_request_duration_seconds_count") != sent:
        assert time.monotonic() < deadline, grown(page, "llm_d_epp_request_duration_seconds_count")
        time.sleep(0.1)
    assert grown(page, "llm_d_epp_request_total") == sent
    assert grown(page, "llm_d_epp_request_error_total", error_code="BadRequest") == {"pool-b": 1}
    assert grown(page, "llm_d_epp_request_error_total", error_code="NotFound") == {"": 1}
    running = _by_pool(page, "llm_d_epp_request_running")
    assert (running.get("pool-a"), running.get("pool-b")) == (0.0, 0.0)  # each pool's, all ended
    # the deprecated name keeps the reference's label set: the pools' series summed
    assert all(
        "inference_pool" not in s.labels
        for f in text_string_to_metric_families(page)
        if f.name == "inference_objective_request"
        for s in f.samples
    )
    assert _total(page, "inference_objective_request_total") == _total(page, "llm_d_epp_request_total")


def test_pools_share_one_redis_connection(rig: Rig, redis_server: RedisServer) -> None:
    """With the redis-syncer on, every pool shares its own state (keys under the pool's name), all
    of them over one connection to the store (the server's CLIENT LIST), not one per pool."""
    config = {
        "plugins": [
            {"name": "shared", "type": "redis-syncer", "parameters": {"address": redis_server.address}},
            {"type": "inflight-load-producer"},
            {"type": "active-request-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "active-request-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
        "dataLayer": {"crossReplica": {"syncerPluginRef": "shared", "syncInterval": "50ms"}},
    }
    sims = rig.start_sims(4)
    epp = rig.start_epp([], config=config)
    pools = {f"pool-{i}": [sim] for i, sim in enumerate(sims)}
    _write_pools(epp.endpoints_file, pools)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    me = raw.client_id()

    def synced() -> set[str]:
        return {k.decode().split(":")[1] for k in raw.keys("llm-d-epp:*:replicas")}

    deadline = time.monotonic() + 20
    while not {f"default/{p}" for p in pools} <= synced():
        assert time.monotonic() < deadline, synced()
        time.sleep(0.1)
    clients = [c for c in raw.client_list() if int(c["id"]) != me]
    assert len(clients) == 1, clients
    raw.close()
