"""Flow control end to end: real Envoy (both body modes), the real ``epp serve``, simulated vLLM servers.

* fairness: with one request in flight allowed, a second tenant's requests overtake the first
  tenant's backlog under ``round-robin-fairness-policy`` (arrival order at the simulator);
* TTL: a request queued past ``defaultRequestTTL`` gets 429 ``rejected-ttl-expired``;
* client disconnect: the queued request leaves the queue at once (flow-control metrics);
* BUFFERED: a request queued longer than Envoy's 5 s ``message_timeout`` is still served (the EPP
  extends the timer);
* stale metrics: with a 30 s scrape interval requests still flow on the in-flight credit, while
  ``stalenessPolicy: saturated`` halts dispatch as the reference does;
* shutdown: a queued request gets 503 ``rejected-shutting-down``;
* eviction: a critical request waiting on a full pool revokes an in-flight sheddable one (429
  ``evicted``), in Kubernetes mode where InferenceObjectives give priorities;
* the reference's flow-control sample configurations serve traffic.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.dev import stack
from tests.fakekube import FakeKube, objects
from tests.integration.harness import (
    BODY_MODES,
    Envoy,
    Epp,
    Response,
    Rig,
    Sim,
    chat_body,
    marker,
    request,
)
from tests.llm_d_corpus import needs_corpus, project_config

pytestmark = pytest.mark.integration

DROPPED = "x-llm-d-request-dropped-reason"
FAIRNESS = "x-llm-d-inference-fairness-id"


def flow_config(
    *, max_concurrency: int = 1, fairness: str = "round-robin-fairness-policy", **flow: Any
) -> dict[str, Any]:
    """Flow control gated by the EPP's own in-flight count (deterministic), one band template."""
    return {
        "featureGates": ["flowControl"],
        "plugins": [
            {
                "name": "gate",
                "type": "concurrency-detector",
                "parameters": {"maxConcurrency": max_concurrency},
            },
            {"name": "fair", "type": fairness},
        ],
        "flowControl": {
            "saturationDetector": {"pluginRef": "gate"},
            "defaultPriorityBand": {"fairnessPolicyRef": "fair"},
            **flow,
        },
    }


def slow_sim(rig: Rig, itl_ms: int, tokens: int) -> Sim:
    """One simulator whose every answer takes about ``itl_ms * tokens`` milliseconds."""
    (sim,) = rig.start_sims(1, extra=["--inter-token-latency", str(itl_ms), "--max-tokens", str(tokens)])
    return sim


def start(
    rig: Rig, sims: Sequence[Sim], config: dict[str, Any], body_mode: str, **epp: Any
) -> tuple[Epp, Envoy]:
    e = rig.start_epp(sims, config=config, **epp)
    return e, rig.start_envoy(e, body_mode=body_mode)


def post(envoy: Envoy, text: str, tenant: str = "") -> Response:
    headers = {FAIRNESS: tenant} if tenant else {}
    return envoy.post("/v1/chat/completions", chat_body(text), headers)


def metric(epp: Epp, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in epp.metrics().splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def queued(epp: Epp) -> float:
    return metric(epp, "llm_d_epp_flow_control_queue_size")


@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_a_second_tenant_overtakes_the_first_tenants_backlog(rig: Rig, body_mode: str) -> None:
    sim = slow_sim(rig, itl_ms=100, tokens=5)
    epp, envoy = start(rig, [sim], flow_config(), body_mode)
    tag = marker()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, envoy, f"{tag}-a0", "tenant-a")]
        wait_for("a0 in flight", lambda: sim.journal() != [])
        for i in range(1, 5):
            futures.append(pool.submit(post, envoy, f"{tag}-a{i}", "tenant-a"))
            wait_for(f"a{i} queued", lambda n=i: queued(epp) >= n)  # arrival order is fixed
        for i in range(2):
            futures.append(pool.submit(post, envoy, f"{tag}-b{i}", "tenant-b"))
            wait_for(f"b{i} queued", lambda n=i: queued(epp) >= 5 + n)
        statuses = [f.result(timeout=60).status for f in futures]
    assert statuses == [200] * 7
    arrivals = [re.search(rf"{tag}-(\w\d)", e["body"]) for e in sim.journal()]
    order = [a.group(1) for a in arrivals if a]
    assert sorted(order) == ["a0", "a1", "a2", "a3", "a4", "b0", "b1"]
    # round robin: a0 was in flight, then the flows alternate; FCFS would serve b0 sixth
    assert order[:4] == ["a0", "b0", "a1", "b1"], order
    assert metric(epp, "llm_d_epp_flow_control_requests_total", outcome="Dispatched") == 7


@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_a_request_queued_past_its_ttl_gets_429_ttl_expired(rig: Rig, body_mode: str) -> None:
    sim = slow_sim(rig, itl_ms=200, tokens=10)  # 2 s in flight
    epp, envoy = start(rig, [sim], flow_config(defaultRequestTTL="300ms"), body_mode)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, envoy, marker())
        wait_for("the first request in flight", lambda: sim.journal() != [])
        late = post(envoy, marker())
        assert long.result(timeout=30).status == 200
    assert late.status == 429, late
    assert late.headers.get(DROPPED) == "rejected-ttl-expired"
    assert "request timed out in queue" in late.json()["error"]["message"]
    assert metric(epp, "llm_d_epp_flow_control_requests_total", outcome="EvictedTTL") == 1
    assert queued(epp) == 0


def test_a_client_that_disconnects_while_queued_leaves_the_queue_at_once(rig: Rig) -> None:
    sim = slow_sim(rig, itl_ms=200, tokens=20)  # 4 s in flight
    epp, envoy = start(rig, [sim], flow_config(), "FULL_DUPLEX_STREAMED")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(post, envoy, marker())
        wait_for("the first request in flight", lambda: sim.journal() != [])
        body = chat_body(marker())
        conn = socket.create_connection(("127.0.0.1", envoy.port))
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for("the second request queued", lambda: queued(epp) == 1)
        conn.close()
        wait_for("the queue emptied", lambda: queued(epp) == 0, timeout=3.0)  # long is still running
        assert not long.done()
        cancelled = metric(epp, "llm_d_epp_flow_control_requests_total", outcome="EvictedContextCancelled")
        assert cancelled == 1
        assert long.result(timeout=30).status == 200
    assert len(sim.journal()) == 1  # the abandoned request never reached the model server


def test_buffered_requests_can_wait_longer_than_envoys_message_timeout(rig: Rig) -> None:
    sim = slow_sim(rig, itl_ms=130, tokens=50)  # 6.5 s in flight, past the 5 s message_timeout
    epp, envoy = start(rig, [sim], flow_config(defaultRequestTTL="30s"), "BUFFERED")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, envoy, marker())
        wait_for("the first request in flight", lambda: sim.journal() != [])
        second = pool.submit(post, envoy, marker())
        assert first.result(timeout=60).status == 200
        resp = second.result(timeout=60)
    assert resp.status == 200, resp
    # it waited in the queue beyond Envoy's 5 s message_timeout, then was dispatched
    name = "llm_d_epp_flow_control_request_queue_duration_seconds_bucket"
    assert metric(epp, name, outcome="Dispatched", le="+Inf") == 2
    assert metric(epp, name, outcome="Dispatched", le="5.0") == 1


def test_stale_metrics_degrade_to_in_flight_credit_instead_of_halting(rig: Rig) -> None:
    sims = rig.start_sims(2)
    config = {
        "featureGates": ["flowControl"],
        "plugins": [{"type": "utilization-detector", "parameters": {"queueDepthThreshold": 2}}],
        "flowControl": {"defaultRequestTTL": "500ms"},
    }
    # one scrape at start-up, then none for 30 s: stale after 200 ms
    slow_scrape = ["--refresh-metrics-interval", "30s"]
    epp, envoy = start(rig, sims, config, "FULL_DUPLEX_STREAMED", extra=slow_scrape)
    time.sleep(0.3)  # past the detector's 200 ms staleness threshold
    statuses = [post(envoy, marker()).status for _ in range(6)]
    assert statuses == [200] * 6
    assert metric(epp, "llm_d_epp_flow_control_stale_endpoints") == 2  # the credit carried them
    strict = {**config, "plugins": [{**config["plugins"][0], "parameters": {"stalenessPolicy": "saturated"}}]}
    _, envoy2 = start(rig, sims, strict, "FULL_DUPLEX_STREAMED", name="epp-strict", extra=slow_scrape)
    time.sleep(0.3)
    halted = post(envoy2, marker())
    assert halted.status == 429 and halted.headers.get(DROPPED) == "rejected-ttl-expired"


def test_queued_requests_get_503_shutting_down_when_the_epp_stops(rig: Rig) -> None:
    sim = slow_sim(rig, itl_ms=200, tokens=25)  # 5 s in flight
    epp, envoy = start(rig, [sim], flow_config(), "FULL_DUPLEX_STREAMED", extra=["--drain-delay", "0.2"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pool.submit(post, envoy, marker())
        wait_for("the first request in flight", lambda: sim.journal() != [])
        waiting = pool.submit(post, envoy, marker())
        wait_for("the second request queued", lambda: queued(epp) == 1)
        assert epp.child.proc is not None
        epp.child.proc.terminate()
        resp = waiting.result(timeout=30)
    assert resp.status == 503, resp
    assert resp.headers.get(DROPPED) == "rejected-shutting-down"


@needs_corpus
@pytest.mark.parametrize("sample", ["wellknown_configs_test-6", "sim-program-aware-config"])
def test_reference_flow_control_samples_serve_traffic(rig: Rig, sample: str) -> None:
    document = yaml.safe_load(project_config(sample).read_text())
    assert "flowControl" in document.get("featureGates", [])
    sims = rig.start_sims(2)
    extra = ["--allow-experimental-plugins"]
    epp, envoy = start(rig, sims, document, "FULL_DUPLEX_STREAMED", extra=extra)
    statuses = [post(envoy, marker(), tenant=f"t{i % 2}").status for i in range(4)]
    assert statuses == [200] * 4
    assert metric(epp, "llm_d_epp_flow_control_requests_total", outcome="Dispatched") == 4


# --- eviction (Kubernetes mode: InferenceObjectives give priorities) ----------------------------

NS = "inference"
OBJECTIVE = "x-gateway-inference-objective"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=0.5) as k:
        yield k


@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_eviction_revokes_an_in_flight_sheddable_request_for_a_critical_one(
    rig: Rig, kube: FakeKube, tmp_path: Path, body_mode: str
) -> None:
    port = stack.free_port()
    extra = ["--inter-token-latency", "200", "--max-tokens", "40"]  # 8 s each
    (sim,) = rig.start_sims(1, prefix="pod", hosts=["127.0.0.31"], port=port, extra=extra)
    kube.create(objects.inference_pool(NS, (port,)))
    kube.create(objects.pod(NS, sim.name, sim.host, ready=True))
    kube.create(objects.objective(NS, "batch", -1))
    config = flow_config(enableEviction=True)
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    epp = rig.start_epp(
        [],
        file_discovery=False,
        config=config,
        extra=["--pool-namespace", NS, "--kubeconfig", str(kubeconfig), "--pool-name", "pool"],
    )
    envoy = rig.start_envoy(epp, body_mode=body_mode)
    batch = {OBJECTIVE: "batch"}
    # the objective is known once a batch request is counted at priority -1
    rig.stack.wait(
        "the sheddable objective to reach the EPP",
        lambda: (
            envoy.post("/v1/chat/completions", chat_body(marker()), batch).status == 200
            and metric(epp, "llm_d_epp_flow_control_requests_total", priority="-1") > 0
        ),
        children=[envoy.child, epp.child],
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sheddable = pool.submit(envoy.post, "/v1/chat/completions", chat_body(marker()), batch)
        wait_for("the sheddable request in flight", lambda: len(sim.journal()) >= 2)
        critical = pool.submit(post, envoy, marker())
        evicted = sheddable.result(timeout=30)
        served = critical.result(timeout=30)
    assert evicted.status == 429, evicted
    assert evicted.headers.get(DROPPED) == "evicted"
    assert served.status == 200, served
    assert metric(epp, "llm_d_epp_flow_control_revocations_issued_total", priority="0") == 1
    assert metric(epp, "llm_d_epp_flow_control_revocations_total", outcome="confirmed") == 1


def _doc_example() -> dict[str, Any]:
    """The configuration of docs/flow-control.md's "Turning it on"."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "flow-control.md").read_text()
    block = doc.split("## Turning it on", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    loaded = yaml.safe_load(block)
    assert isinstance(loaded, dict)
    return loaded


def test_the_docs_example_keeps_every_engine_queue_empty(rig: Rig) -> None:
    batch, requests = 2, 60
    sims = rig.start_sims(
        3, extra=["--max-num-seqs", str(batch), "--inter-token-latency", "5", "--max-tokens", "8"]
    )
    config = _doc_example()
    for plugin in config["plugins"]:
        if plugin.get("type") == "concurrency-detector":
            plugin["parameters"]["maxConcurrency"] = batch  # the example's "engine batch size"
    epp, envoy = start(rig, sims, config, "BUFFERED")
    for sim in sims:  # the peaks start now
        assert request(f"{sim.url}/sim/stats/reset", "POST", b"").status == 200
    shared = "You are a helpful assistant. " * 40  # one long system prompt: prefix affinity pulls
    tag = marker()

    def ask(i: int) -> int:
        messages = [{"role": "system", "content": shared}, {"role": "user", "content": f"{tag}-{i}"}]
        body = json.dumps({"model": "demo", "messages": messages}).encode()
        return envoy.post("/v1/chat/completions", body).status

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(ask, range(requests)))
    assert statuses == [200] * requests
    peaks = [json.loads(request(f"{sim.url}/sim/stats").body) for sim in sims]
    assert [p["peak_waiting"] for p in peaks] == [0] * len(sims), peaks
    assert all(p["peak_running"] == batch for p in peaks), peaks  # both engines were kept busy
    assert metric(epp, "llm_d_epp_flow_control_requests_total", outcome="Dispatched") == requests


def test_an_objectives_file_gives_priorities_without_kubernetes(rig: Rig, tmp_path: Path) -> None:
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text("objectives:\n- {name: critical, priority: 10}\n- {name: batch, priority: -1}\n")
    sim = slow_sim(rig, itl_ms=100, tokens=5)
    epp, envoy = start(
        rig, [sim], flow_config(max_concurrency=1), "BUFFERED", extra=["--objectives-file", str(objectives)]
    )
    tag = marker()

    def ask(name: str, objective: str = "") -> Response:
        headers = {"x-llm-d-inference-objective": objective} if objective else {}
        return envoy.post("/v1/chat/completions", chat_body(f"{tag}-{name}"), headers)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, "first")]
        wait_for("the first request in flight", lambda: sim.journal() != [])
        futures.append(pool.submit(ask, "batch", "batch"))
        wait_for("batch queued", lambda: queued(epp) >= 1)
        futures.append(pool.submit(ask, "critical", "critical"))
        wait_for("critical queued", lambda: queued(epp) >= 2)
        assert [f.result(timeout=30).status for f in futures] == [200, 200, 200]
    arrivals = [re.search(rf"{tag}-(\w+)", e["body"]) for e in sim.journal()]
    # the critical objective's band (priority 10) dispatches before the sheddable one's (-1)
    assert [a.group(1) for a in arrivals if a] == ["first", "critical", "batch"]
    for priority in ("10", "-1"):
        dispatched = metric(
            epp, "llm_d_epp_flow_control_requests_total", outcome="Dispatched", priority=priority
        )
        assert dispatched == 1
