"""``--log-level=debug`` explains every routing decision in one line per request (the endpoint
picked, each scorer's best endpoints, each profile's outcome) and keeps the libraries' debug lines
(grpc, hpack, asyncio) out unless asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.harness import Rig, chat_body, marker

pytestmark = pytest.mark.integration


def _json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_debug_log_has_one_decision_line_per_request_and_no_library_debug(rig: Rig) -> None:
    sims = rig.start_sims(2)
    epp = rig.start_epp(sims, extra=["--log-level", "debug"])
    envoy = rig.start_envoy(epp)
    by_port = {s.port: s.name for s in sims}
    markers = [marker() for _ in range(4)]
    served = []
    for m in markers:
        resp = envoy.post("/v1/chat/completions", chat_body(m))
        assert resp.status == 200, resp
        served.append(by_port[resp.port])

    log = epp.child.log_path
    decisions = [e for e in _json_lines(log) if e.get("event") == "request.scheduled"]
    assert len(decisions) == len(markers)  # one line per request (the readiness probes are not routed)
    for line, name in zip(decisions, served, strict=True):
        assert line["level"] == "debug"
        assert line["request_id"]
        assert line["picked"] == [name]
        assert line["candidates"] == 2
        (profile,) = line["profiles"]
        assert profile["picked"] == [name]
        assert "error" not in profile
        # the default configuration's scorer, with both endpoints ranked
        default_scorers = {"prefix-spread-scorer"}
        assert default_scorers <= set(profile["scorers"])
        assert all(len(top) == 2 for top in profile["scorers"].values())
    text = log.read_text()
    assert "DEBUG hpack" not in text and "DEBUG grpc" not in text and "DEBUG asyncio" not in text
