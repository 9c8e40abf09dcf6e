"""With the EPP down, fail-open Envoy still serves (from its fallback cluster) and fail-closed answers 5xx."""

from __future__ import annotations

import time

import pytest

from tests.integration.harness import BODY_MODES, Envoy, Rig, chat_body, marker

pytestmark = pytest.mark.integration

DESTINATION = "x-gateway-destination-endpoint"
POLL_TIMEOUT = 15.0


def _wait_until_epp_marked_unhealthy(envoy: Envoy) -> None:
    """Until Envoy's active health check has marked the EPP failed (fail-open then applies at once).

    Before that, FULL_DUPLEX_STREAMED requests may get 500 or, when the connection failure is seen
    before the first body chunk went out, already fail open: polling for one 200 would be racy.
    """
    deadline = time.monotonic() + POLL_TIMEOUT
    while not any("failed_active_hc" in flags for flags in envoy.health_flags("ext_proc")):
        assert time.monotonic() < deadline, f"EPP never marked unhealthy: {envoy.health_flags('ext_proc')}"
        time.sleep(0.05)


# STREAMED (send_body_without_waiting_for_header_response) is supported too, though not a default.
@pytest.mark.parametrize("how", ["stop", "crash"])
@pytest.mark.parametrize("mode", [*BODY_MODES, "STREAMED"])
def test_epp_down(rig: Rig, mode: str, how: str) -> None:
    sims = rig.start_sims(2)
    (rogue,) = rig.start_sims(1, prefix="rogue")
    epp = rig.start_epp(sims)
    open_envoy = rig.start_envoy(epp, body_mode=mode, fail_open=True, fallback=sims)
    closed_envoy = rig.start_envoy(epp, body_mode=mode)
    ports = {s.port for s in sims}

    # While the EPP runs, both route through it.
    for envoy in (open_envoy, closed_envoy):
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m))
        assert resp.status == 200, resp
        entry = next(e for s in sims if (e := s.find(m)) is not None)
        assert entry["headers"][DESTINATION] in {s.address for s in sims}

    if how == "crash":
        epp.child.kill()
    else:
        epp.stop()

    # Fail-open: served by a fallback endpoint, without an EPP decision, and a client header cannot
    # steer it (the rogue sim is not a fallback endpoint). Envoy's health check notices the EPP's
    # absence within about 1.5 s (three failed checks in a row).
    _wait_until_epp_marked_unhealthy(open_envoy)
    for _ in range(6):
        m = marker()
        resp = open_envoy.post("/v1/chat/completions", chat_body(m), {DESTINATION: rogue.address})
        assert resp.status == 200, resp
        assert resp.port in ports
        entry = next(e for s in sims if (e := s.find(m)) is not None)
        assert DESTINATION not in entry["headers"]
    get = open_envoy.get("/v1/models")
    assert get.status == 200, get
    assert get.port in ports
    assert rogue.journal() == []

    # Fail-closed: every request fails.
    for resp in (
        closed_envoy.post("/v1/chat/completions", chat_body(marker())),
        closed_envoy.post("/v1/chat/completions", chat_body(marker()), {DESTINATION: rogue.address}),
        closed_envoy.get("/v1/models"),
    ):
        assert 500 <= resp.status < 600, resp
        assert resp.port is None, "a model server answered although the EPP is down"
    assert rogue.journal() == []
