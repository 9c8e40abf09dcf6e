"""A dead engine costs no request: through a real Envoy (the generated lean bootstrap), the EPP and
simulators. A killed engine's requests fail over to another endpoint; a wrong port gets nothing;
a restarted engine is back within one scrape; an upstream failure is an OpenAI-style error."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from epp.dev import stack
from tests.integration.harness import SIM_ARGS, Rig, Sim, chat_body, marker

pytestmark = pytest.mark.integration

POLL_TIMEOUT = 10.0


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _kill(sim: Sim) -> None:
    sim.child.kill()  # SIGKILL: the port refuses from now on


def test_killed_engine_fails_over_and_is_ejected(rig: Rig) -> None:
    # Scrapes every 10 s: only the data path (Envoy's retry and its failure log) can notice the death.
    sims = rig.start_sims(3)
    epp = rig.start_epp(
        sims, extra=["--refresh-metrics-interval", "10s", "--metrics-staleness-threshold", "30s"]
    )
    envoy = rig.start_envoy(epp)
    _kill(sims[0])
    with ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(lambda _: envoy.post("/v1/chat/completions", chat_body(marker())), range(24))
        )
    assert [r.status for r in responses] == [200] * 24, [r for r in responses if r.status != 200][:1]
    assert {r.port for r in responses} <= {sims[1].port, sims[2].port}
    assert envoy.stat("cluster.fallback_destination_cluster.upstream_rq_total") >= 1  # failed over
    deadline = time.monotonic() + POLL_TIMEOUT
    while _metric(epp.metrics(), 'llm_d_epp_endpoint_ejections_total{reason="connect"}') < 1:
        assert time.monotonic() < deadline, "the dead engine was never ejected"
        time.sleep(0.05)
    # Ejected: later requests are not even tried on it.
    tried = envoy.stat("cluster.fallback_destination_cluster.upstream_rq_total")
    for _ in range(10):
        assert envoy.post("/v1/chat/completions", chat_body(marker())).status == 200
    assert envoy.stat("cluster.fallback_destination_cluster.upstream_rq_total") == tried


def test_wrong_port_gets_nothing_and_a_restarted_engine_is_back_within_a_scrape(rig: Rig) -> None:
    sims = rig.start_sims(2)
    wrong = Sim("wrong-port", stack.free_port(), sims[0].child)  # nothing listens there
    epp = rig.start_epp([*sims, wrong])
    envoy = rig.start_envoy(epp)
    # (before the first scrapes nothing is known: a readiness GET may still have tried it)
    refused = envoy.stat("cluster.original_destination_cluster.upstream_cx_connect_fail")
    for i in range(30):
        resp = envoy.post("/v1/chat/completions", chat_body(marker())) if i % 3 else envoy.get("/v1/models")
        assert resp.status == 200, resp
    assert envoy.stat("cluster.original_destination_cluster.upstream_cx_connect_fail") == refused

    victim = sims[0]
    _kill(victim)
    deadline = time.monotonic() + POLL_TIMEOUT
    down = 'llm_d_epp_datalayer_endpoints{state="down"}'
    while _metric(epp.metrics(), down) != 2:  # the wrong port and the killed engine
        assert time.monotonic() < deadline
        time.sleep(0.02)
    restarted = rig.add_sim("sim-restarted", [*SIM_ARGS, "--host", "127.0.0.1"], port=victim.port)
    rig.stack.wait_sim(restarted.child, restarted.url)
    t0 = time.monotonic()
    while _metric(epp.metrics(), down) != 1:
        assert time.monotonic() - t0 < 1.0, "not back within one scrape (50 ms) plus polling"
        time.sleep(0.01)
    ports = {envoy.post("/v1/chat/completions", chat_body(marker())).port for _ in range(30)}
    assert victim.port in ports


def test_upstream_failure_is_an_openai_error_naming_the_endpoint(rig: Rig) -> None:
    (sim,) = rig.start_sims(1)
    epp = rig.start_epp([sim])
    envoy = rig.start_envoy(epp)
    _kill(sim)
    resp = envoy.post("/v1/chat/completions", chat_body(marker()))
    assert resp.status == 503, resp
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == "service_unavailable"
    assert error["code"] in {"upstream_connect_failure", "no_healthy_upstream"}
    assert error["message"]
    if error["code"] == "upstream_connect_failure":
        assert resp.headers["x-epp-upstream-endpoint"] == sim.address
