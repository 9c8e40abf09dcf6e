"""Kubernetes mode end to end: a real ``epp serve --pool-name`` (and ``--endpoint-selector``) against
the in-process fake API server, real Envoy and real simulators, each "pod" a simulator on its own
loopback IP (127.0.0.x) and the pool's one target port.

Also two EPP replicas with ``--ha-enable-leader-election``: one is ready, the standby keeps a warm
datastore, and the standby takes over when the leader stops renewing (SIGSTOP) or shuts down
(SIGTERM releases the Lease). The switchover times are measured and reported as test properties.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main as epp_main
from epp.dev import stack
from tests.fakekube import FakeKube, objects
from tests.integration.harness import MODEL, Envoy, Epp, Rig, Sim, chat_body, marker

pytestmark = pytest.mark.integration

NS = "inference"
POOL_API = objects.POOL_API
HOSTS = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=0.5) as k:
        yield k


def pool_obj(port: int) -> dict[str, Any]:
    return objects.inference_pool(NS, (port,))


def pod_obj(sim: Sim, *, ready: bool = True) -> dict[str, Any]:
    return objects.pod(NS, sim.name, sim.host, ready=ready)


def kube_args(kube: FakeKube, tmp_path: Path, *extra: str) -> list[str]:
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    return ["--pool-namespace", NS, "--kubeconfig", str(config), *extra]


def served_by(envoy: Envoy, n: int, **body: Any) -> Counter[str]:
    """Send ``n`` chat requests; count the answering pods (x-inference-pod). All must succeed."""
    pods: Counter[str] = Counter()
    for _ in range(n):
        resp = envoy.post("/v1/chat/completions", chat_body(marker(), **body))
        assert resp.status == 200, (resp.status, resp.body[:300])
        pods[resp.headers["x-inference-pod"]] += 1
    return pods


def eventually(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_inferencepool_discovery_routes_through_envoy_as_pods_come_and_go(
    rig: Rig, kube: FakeKube, tmp_path: Path
) -> None:
    port = stack.free_port()
    sims = rig.start_sims(3, prefix="pod", hosts=HOSTS, port=port)
    kube.create(pool_obj(port))
    kube.create(pod_obj(sims[0]))
    kube.create(pod_obj(sims[1]))
    epp = rig.start_epp([], file_discovery=False, extra=kube_args(kube, tmp_path, "--pool-name", "pool"))
    envoy = rig.start_envoy(epp)

    assert set(served_by(envoy, 12)) <= {sims[0].name, sims[1].name}

    kube.create(pod_obj(sims[2]))  # scale up
    eventually(lambda: sims[2].name in served_by(envoy, 6), "the new pod to receive requests")

    kube.patch(
        "v1", "Pod", NS, sims[0].name, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    eventually(lambda: sims[0].name not in served_by(envoy, 1), "the unready pod to leave")
    assert sims[0].name not in served_by(envoy, 12)

    # The API server drops every watch and compacts its history: the EPP relists and catches up.
    kube.compact()
    assert kube.drop_watches() >= 1
    kube.delete("v1", "Pod", NS, sims[1].name)
    kube.compact()
    eventually(lambda: set(served_by(envoy, 6)) == {sims[2].name}, "only the remaining pod to serve")

    # The pool itself is deleted: no endpoints, Envoy gets the EPP's 503.
    kube.delete(POOL_API, "InferencePool", NS, "pool")
    eventually(
        lambda: envoy.post("/v1/chat/completions", chat_body(marker())).status == 503, "503 without a pool"
    )
    assert not stack.grpc_serving(epp.health_port)
    assert stack.grpc_serving(epp.health_port, "liveness")


def test_objective_priority_and_model_rewrite_from_their_resources(
    rig: Rig, kube: FakeKube, tmp_path: Path
) -> None:
    port = stack.free_port()
    (sim,) = rig.start_sims(1, prefix="pod", hosts=HOSTS[:1], port=port)
    kube.create(pool_obj(port))
    kube.create(pod_obj(sim))
    kube.create(objects.objective(NS, "critical", 7))
    kube.create(objects.model_rewrite(NS, "alias", "friendly-name", {MODEL: 100}))
    epp = rig.start_epp([], file_discovery=False, extra=kube_args(kube, tmp_path, "--pool-name", "pool"))
    envoy = rig.start_envoy(epp, response_body_mode="BUFFERED")

    def rewritten() -> bool:
        tag = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(tag, model="friendly-name"))
        if resp.status != 200:
            return False
        entry = sim.find(tag)
        assert entry is not None and json.loads(entry["body"])["model"] == MODEL  # the server got the target
        assert resp.json()["model"] == "friendly-name"  # the client sees its own name back
        return True

    eventually(rewritten, "the InferenceModelRewrite to apply")
    resp = envoy.post(
        "/v1/chat/completions", chat_body(marker()), headers={"x-gateway-inference-objective": "critical"}
    )
    assert resp.status == 200
    eventually(
        lambda: 'priority="7"' in epp.metrics() and 'model_rewrite_name="alias"' in epp.metrics(),
        "objective priority and rewrite decisions in the metrics",
    )


def test_standalone_endpoint_selector_mode(rig: Rig, kube: FakeKube, tmp_path: Path) -> None:
    port = stack.free_port()
    sims = rig.start_sims(2, prefix="pod", hosts=HOSTS[:2], port=port)
    for sim in sims:
        kube.create(pod_obj(sim))
    extra = kube_args(kube, tmp_path, "--endpoint-selector", "app=vllm", "--endpoint-target-ports", str(port))
    epp = rig.start_epp([], file_discovery=False, extra=extra)
    envoy = rig.start_envoy(epp)
    eventually(lambda: set(served_by(envoy, 10)) == {s.name for s in sims}, "both pods to serve")
    assert not any("inferencepools" in path for _, path, _ in kube.requests)


# ------------------------------------------------------------------------------- leader election

HA = ("--ha-enable-leader-election", "--ha-lease-duration=2s", "--ha-renew-deadline=1.5s")


def _start_replicas(rig: Rig, kube: FakeKube, tmp_path: Path) -> tuple[Epp, Epp]:
    port = stack.free_port()
    (sim,) = rig.start_sims(1, prefix="pod", hosts=HOSTS[:1], port=port)
    kube.create(pool_obj(port))
    kube.create(pod_obj(sim))
    extra = kube_args(
        kube,
        tmp_path,
        "--pool-name",
        "pool",
        *HA,
        "--ha-retry-period=0.2s",
        "--refresh-prometheus-metrics-interval=0.2s",
    )
    a = rig.start_epp([], name="epp-a", file_discovery=False, wait_ready=False, extra=extra)
    b = rig.start_epp([], name="epp-b", file_discovery=False, wait_ready=False, extra=extra)
    return a, b


def _ready(epp: Epp) -> bool:
    return stack.grpc_serving(epp.health_port)


def _leader(a: Epp, b: Epp) -> tuple[Epp, Epp]:
    eventually(lambda: _ready(a) != _ready(b), "exactly one ready replica")
    return (a, b) if _ready(a) else (b, a)


def _switchover(new: Epp, since: float) -> float:
    eventually(lambda: _ready(new), "the standby to become ready", timeout=30.0)
    return time.monotonic() - since


def test_two_replicas_elect_one_leader_and_fail_over(
    rig: Rig, kube: FakeKube, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    a, b = _start_replicas(rig, kube, tmp_path)
    leader, standby = _leader(a, b)
    assert stack.grpc_serving(standby.health_port, "liveness")
    # the standby's datastore and metrics are warm: it sees the pool's pod too
    eventually(lambda: 'inference_pool_ready_pods{name="pool"} 1.0' in standby.metrics(), "warm standby")

    # 1. the leader stops renewing (frozen, as a hung or partitioned process): the standby takes
    #    over once the lease expires
    os.kill(leader.child.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    took_expiry = _switchover(standby, frozen)
    os.kill(leader.child.pid, signal.SIGCONT)
    # the old leader notices the new holder and steps down: never two ready replicas for long
    eventually(lambda: not _ready(leader), "the old leader to step down")
    assert _ready(standby)

    # 2. graceful shutdown releases the Lease: a fast handover
    stopped = time.monotonic()
    os.kill(standby.child.pid, signal.SIGTERM)
    took_release = _switchover(leader, stopped)

    record_property("switchover_lease_expiry_s", round(took_expiry, 2))
    record_property("switchover_release_s", round(took_release, 2))
    print(f"switchover: lease expiry {took_expiry:.2f} s, released lease {took_release:.2f} s")
    assert took_expiry >= 1.5  # safety: not before the 2 s lease could have expired (minus one retry)
    lease = kube.get(
        "coordination.k8s.io/v1",
        "Lease",
        NS,
        "epp-inference-pool.gateway-api-inference-extension.sigs.k8s.io",
    )
    assert lease is not None and lease["spec"]["leaseTransitions"] >= 2


def _indexer_size(epp: Epp) -> float:
    for line in epp.metrics().splitlines():
        if line.startswith("inference_extension_prefix_indexer_size"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_new_leader_routes_known_prefixes_where_the_old_leader_did(
    rig: Rig, kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_IP", "127.0.0.1")  # the advertised replication address: POD_IP:replication port
    certs = tmp_path / "certs"
    assert epp_main(["certs", "--out", str(certs)]) == 0  # the replicas' mutual-TLS certificate
    port = stack.free_port()
    sims = rig.start_sims(3, prefix="pod", hosts=HOSTS, port=port)
    kube.create(pool_obj(port))
    for sim in sims:
        kube.create(pod_obj(sim))
    extra = kube_args(kube, tmp_path, "--pool-name", "pool", *HA, "--ha-retry-period=0.2s")
    extra += [f"--ha-replication-cert-path={certs / 'epp'}"]
    a, b = (
        rig.start_epp(
            [],
            name=f"epp-{name}",
            file_discovery=False,
            wait_ready=False,
            extra=[*extra, f"--ha-replication-port={stack.free_port()}"],
        )
        for name in "ab"
    )
    leader, standby = _leader(a, b)
    via_leader = rig.start_envoy(leader, name="envoy-leader")
    via_standby = rig.start_envoy(standby, name="envoy-standby")

    shared = ["".join(f"group {g} shared system prompt, part {i}. " for i in range(60)) for g in range(6)]

    def ask(envoy: Envoy, group: int) -> str:
        body = json.dumps(
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": shared[group] + marker()}],
            }
        ).encode()
        resp = envoy.post("/v1/chat/completions", body)
        assert resp.status == 200, resp.body[:200]
        return resp.headers["x-inference-pod"]

    home = {g: ask(via_leader, g) for g in range(6)}
    for g in range(6):  # the old leader keeps each group where it sent it
        assert ask(via_leader, g) == home[g]
    eventually(lambda: _indexer_size(standby) == _indexer_size(leader) > 0, "the standby's index to catch up")

    os.kill(leader.child.pid, signal.SIGTERM)
    eventually(lambda: _ready(standby), "the standby to take over")
    moved = {g: pod for g in range(6) if (pod := ask(via_standby, g)) != home[g]}
    assert not moved, f"groups routed elsewhere after the failover: {moved} (homes {home})"
