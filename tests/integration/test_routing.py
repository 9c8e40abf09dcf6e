"""Requests through a real Envoy reach the endpoint the EPP picked, with their bodies intact."""

from __future__ import annotations

import hashlib
import json

import pytest

from epp.dev import stack
from tests.integration.harness import (
    BODY_MODES,
    MODEL,
    Envoy,
    Epp,
    Rig,
    Shared,
    chat_body,
    completion_body,
    marker,
)

pytestmark = pytest.mark.integration

APIS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _assert_landed_on_picked_endpoint(shared: Shared, port: int | None, text: str, sent: bytes) -> None:
    """The answering sim got the request, with the EPP's destination equal to its own address."""
    sim = shared.sim_by_port(port)
    assert sim in shared.sims, f"request served by {sim.name}, which is not in the pool"
    entry = sim.find(text)
    assert entry is not None, f"{sim.name} answered but has no journal entry for {text}"
    assert entry["headers"].get("x-gateway-destination-endpoint") == sim.address
    assert entry["body"].encode() == sent, "the request body was altered on the way"
    for other in shared.sims:
        if other is not sim:
            assert other.find(text) is None, f"{other.name} also received the request"


@pytest.mark.parametrize("api", sorted(APIS))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_request_lands_on_the_endpoint_the_epp_chose(
    shared: Shared, envoy: Envoy, api: str, stream: bool
) -> None:
    m = marker()
    body = chat_body(m, stream=stream) if api == "chat" else completion_body(m, stream=stream)
    resp = envoy.post(APIS[api], body)
    assert resp.status == 200, resp
    _assert_landed_on_picked_endpoint(shared, resp.port, m, body)
    if stream:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.body.decode().splitlines() if line.startswith("data:")]
        assert events[-1].strip() == "data: [DONE]"
        first = json.loads(events[0].removeprefix("data:").strip())
        assert first["model"] == MODEL
    else:
        data = resp.json()
        assert data["model"] == MODEL
        assert data["choices"], data
        assert data["object"] == ("chat.completion" if api == "chat" else "text_completion")


def test_unusual_json_arrives_byte_for_byte(shared: Shared, envoy: Envoy) -> None:
    """Key order, spacing, escapes and big integers survive: no re-encoding when the model is kept."""
    m = marker()
    message = '{"role":"user", "content":"' + m + ' caf\\u00e9 <b>&</b>"}'
    body = (
        '{ "seed" : 12345678901234567890, "messages" : [ ' + message + " ],"
        '  "temperature": 1.0e0, "model" : "demo" }'
    ).encode()
    resp = envoy.post("/v1/chat/completions", body)
    assert resp.status == 200, resp
    _assert_landed_on_picked_endpoint(shared, resp.port, m, body)


def test_requests_carry_an_x_request_id(shared: Shared, envoy: Envoy) -> None:
    """Envoy (use_remote_address, as the reference) replaces a client's id at the edge; one always arrives."""
    m = marker()
    resp = envoy.post("/v1/chat/completions", chat_body(m), {"x-request-id": f"rid-{m}"})
    assert resp.status == 200, resp
    entry = shared.sim_by_port(resp.port).find(m)
    assert entry is not None
    assert entry["headers"].get("x-request-id")


def test_get_models_is_routed_to_some_endpoint(shared: Shared, envoy: Envoy) -> None:
    resp = envoy.get("/v1/models")
    assert resp.status == 200, resp
    assert resp.port in {s.port for s in shared.sims}
    assert MODEL in [m["id"] for m in resp.json()["data"]]


@pytest.mark.parametrize("mode", BODY_MODES)
def test_5mb_body_is_forwarded_intact(shared: Shared, mode: str) -> None:
    envoy = shared.envoys[mode]
    for sim in shared.sims:
        sim.clear()
    m = marker()
    prompt = (m + " " + "lorem ipsum dolor sit amet " * 200_000)[: 5 * 1024 * 1024]
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    assert len(body) > 5 * 1024 * 1024
    replies_before = envoy.stat("http.inference.ext_proc.stream_msgs_received")
    resp = envoy.post("/v1/completions", body)
    assert resp.status == 200, resp
    sim = shared.sim_by_port(resp.port)
    entry = sim.find(m)
    assert entry is not None
    received = entry["body"].encode()
    assert len(received) == len(body)
    assert hashlib.sha256(received).digest() == hashlib.sha256(body).digest()
    assert entry["headers"].get("x-gateway-destination-endpoint") == sim.address
    if mode == "FULL_DUPLEX_STREAMED":
        # The EPP re-sends the body as streamed_response pieces of at most 62000 bytes: at least
        # ceil(len / 62000) body replies plus the header and response-header replies.
        replies = envoy.stat("http.inference.ext_proc.stream_msgs_received") - replies_before
        assert replies >= -(-len(body) // 62000) + 1


def _inflight(epp: Epp) -> float:
    """The sum of the EPP's per-endpoint in-flight request counts."""
    total = 0.0
    for line in epp.metrics().splitlines():
        if line.startswith("llm_d_epp_endpoint_inflight_requests{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_skip_unused_response_phases_leaves_two_messages_a_request(rig: Rig) -> None:
    """A gateway's BUFFERED layout with response phases: the EPP turns them off per request."""
    sims = rig.start_sims(2)
    sent: dict[str, int] = {}
    for name, extra in (("phases", []), ("skip", ["--skip-unused-response-phases"])):
        epp = rig.start_epp(sims, name=f"epp-{name}", extra=extra)
        envoy = rig.start_envoy(
            epp,
            body_mode="BUFFERED",
            response_header_mode="SEND",
            response_body_mode="STREAMED",
            name=f"envoy-{name}",
        )
        stat = "http.inference.ext_proc.stream_msgs_sent"
        before = envoy.stat(stat)
        for _ in range(4):
            resp = envoy.post("/v1/chat/completions", chat_body(marker(), stream=True))
            assert resp.status == 200, resp
            assert resp.body.decode().rstrip().endswith("data: [DONE]")
        sent[name] = envoy.stat(stat) - before
        # The stream still lasts to the response end: the in-flight counts come back to 0.
        stack.wait_until(f"{name}: nothing in flight", lambda e=epp: _inflight(e) == 0, timeout=10)
    assert sent["skip"] == 2 * 4  # request headers and body only
    assert sent["phases"] > 3 * 4  # plus response headers and every response chunk


@pytest.mark.parametrize("server", ["epp", "grpcio"])
@pytest.mark.parametrize("mode", BODY_MODES)
def test_both_extproc_servers_route_long_and_short_bodies(rig: Rig, server: str, mode: str) -> None:
    """``--extproc-server``: epp's own gRPC server and grpc.aio route the same requests, short and
    long (a body over several HTTP/2 frames), and release them when the response ends."""
    sims = rig.start_sims(2)
    epp = rig.start_epp(sims, name=f"epp-{server}", extra=["--extproc-server", server])
    envoy = rig.start_envoy(epp, body_mode=mode, name=f"envoy-{server}-{mode.lower()}")
    by_port = {s.port: s for s in sims}
    for size in (0, 300_000):
        m = marker()
        body = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": m + " " + "x" * size}]}
        ).encode()
        resp = envoy.post("/v1/chat/completions", body)
        assert resp.status == 200, resp
        sim = by_port[resp.port]
        entry = sim.find(m)
        assert entry is not None and entry["body"].encode() == body
        assert entry["headers"].get("x-gateway-destination-endpoint") == sim.address
    stack.wait_until(f"{server}: nothing in flight", lambda: _inflight(epp) == 0, timeout=10)
