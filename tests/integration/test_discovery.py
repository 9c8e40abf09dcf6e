"""Endpoints added to or removed from the file-discovery file take effect without a restart."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.integration.harness import SUBSET_HEADER, Envoy, Rig, Sim, chat_body, marker

pytestmark = pytest.mark.integration

POLL_TIMEOUT = 30.0


def _poll(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _hinted_status(envoy: Envoy, sim: Sim) -> int:
    return envoy.post("/v1/chat/completions", chat_body(marker()), {SUBSET_HEADER: sim.address}).status


def test_added_endpoint_gets_traffic_and_removed_one_stops(rig: Rig) -> None:
    sims = rig.start_sims(3)
    first, second, new = sims
    epp = rig.start_epp([first, second])
    envoy = rig.start_envoy(epp, subset_hint_header=SUBSET_HEADER)

    # Not in the pool yet: the EPP cannot pick it even when asked to.
    assert _hinted_status(envoy, new) == 503

    epp.set_endpoints(sims)
    _poll(
        "the new endpoint to serve a request",
        lambda: envoy.post("/v1/chat/completions", chat_body(marker())).port == new.port,
    )
    assert _hinted_status(envoy, new) == 200

    epp.set_endpoints([second, new])
    _poll("the removed endpoint to leave the pool", lambda: _hinted_status(envoy, first) == 503)
    first.clear()
    for _ in range(30):
        resp = envoy.post("/v1/chat/completions", chat_body(marker()))
        assert resp.status == 200, resp
        assert resp.port in {second.port, new.port}
    assert first.journal() == []
