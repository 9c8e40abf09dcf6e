"""Clients cannot steer routing or inject EPP-owned headers."""

from __future__ import annotations

import pytest

from tests.integration.harness import Envoy, Shared, chat_body, completion_body, marker

pytestmark = pytest.mark.integration

DESTINATION = "x-gateway-destination-endpoint"
PD_HEADERS = ("x-prefiller-host-port", "x-encoder-hosts-ports")


def test_client_destination_header_does_not_steer(shared: Shared, envoy: Envoy) -> None:
    """A client naming an endpoint outside the pool (the rogue sim) never reaches it."""
    for _ in range(10):
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m), {DESTINATION: shared.rogue.address})
        assert resp.status == 200, resp
        sim = shared.sim_by_port(resp.port)
        assert sim in shared.sims
        entry = sim.find(m)
        assert entry is not None
        assert entry["headers"][DESTINATION] == sim.address
    assert shared.rogue.journal() == []


def test_client_destination_header_cannot_break_routing(shared: Shared, envoy: Envoy) -> None:
    """An unusable client value (a dead port, a list) is discarded, not forwarded to ORIGINAL_DST."""
    for value in ("127.0.0.1:1", "127.0.0.1:1,127.0.0.1:2", "garbage"):
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m), {DESTINATION: value})
        assert resp.status == 200, (value, resp)
        assert shared.sim_by_port(resp.port) in shared.sims


def test_client_get_cannot_steer(shared: Shared, envoy: Envoy) -> None:
    for _ in range(5):
        resp = envoy.get("/v1/models", {DESTINATION: shared.rogue.address})
        assert resp.status == 200, resp
        assert resp.port in {s.port for s in shared.sims}


def test_client_pd_headers_never_reach_the_model_server(shared: Shared, envoy: Envoy) -> None:
    headers = {PD_HEADERS[0]: shared.rogue.address, PD_HEADERS[1]: f"{shared.rogue.address},10.0.0.1:80"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        m = marker()
        body = chat_body(m) if path == "/v1/chat/completions" else completion_body(m)
        resp = envoy.post(path, body, headers)
        assert resp.status == 200, resp
        entry = shared.sim_by_port(resp.port).find(m)
        assert entry is not None
        for name in PD_HEADERS:
            assert name not in entry["headers"], f"client-sent {name} reached the model server"
