"""Every decision can be explained, and the explanations are the scores that decided: one sim has a
waiting queue, the other none, so the load the default scorer reads (the engine's running + waiting
requests) decides; the Envoy access log (the ``epp.decision``
dynamic metadata), the sampled decision log, the operator-enabled response header and
``/debug/decisions`` all show the same picked endpoint, with the top weighted sum. The client's
``x-request-id`` comes back and names the decision."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from tests.integration.harness import JSON_HEADERS, MODEL, Rig, chat_body, marker, request

pytestmark = pytest.mark.integration


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            out.append(json.loads(line[start:]))
        except ValueError:
            continue
    return out


def _queue(sim_url: str, count: int, stop: threading.Event) -> list[threading.Thread]:
    """``count`` slow requests straight to a sim that runs one at a time: the rest wait in its queue."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "slow"}], "max_tokens": 200}
    ).encode()

    def run() -> None:
        while not stop.is_set():
            try:
                request(f"{sim_url}/v1/chat/completions", "POST", body, JSON_HEADERS, timeout=60)
            except OSError:  # the rig stopped the sim
                return

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def _waiting(sim_url: str) -> float:
    for line in request(f"{sim_url}/metrics").body.decode().splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _weighted_sum(entry: dict[str, Any]) -> float:
    return float(sum(entry["scores"].values()))


def test_the_scores_shown_are_the_ones_that_decided(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    busy = rig.start_sims(1, prefix="busy", extra=["--max-num-seqs", "1", "--inter-token-latency", "10"])[0]
    idle = rig.start_sims(1, prefix="idle")[0]
    epp = rig.start_epp(
        [busy, idle],
        extra=[
            "--log-level",
            "info",
            "--decision-log-sample-rate",
            "1",
            "--decision-response-header",
            "--decision-metadata",
        ],
    )
    envoy = rig.start_envoy(epp, access_log=True, response_header_mode="SEND")
    stop = threading.Event()
    # a queue deeper than what the three routed requests add to the idle sim (each a new prompt,
    # counted as newPromptWeight 2 requests by prefix-spread-scorer): the queue decides every time
    _queue(busy.url, 8, stop)
    try:
        deadline = time.monotonic() + 20
        while _waiting(busy.url) < 6:
            assert time.monotonic() < deadline, "the busy sim never queued"
            time.sleep(0.05)
        time.sleep(0.3)  # the EPP's scrape (50 ms) sees the queue
        ids = [f"client-{marker()}" for _ in range(3)]
        responses = [
            envoy.post("/v1/chat/completions", chat_body(marker()), {"x-request-id": rid}) for rid in ids
        ]
    finally:
        stop.set()
    for resp, rid in zip(responses, ids, strict=True):
        assert resp.status == 200, resp
        assert resp.port == idle.port  # the queue decided
        assert resp.headers.get("x-request-id") == rid  # the client's id comes back
        header = resp.headers["x-epp-decision"]
        assert header.startswith("default: *" + idle.address + "=")

    # /debug/decisions: newest first, each with the request id the client sent
    ring = request(f"http://127.0.0.1:{epp.metrics_port}/debug/decisions?limit=50").json()
    assert ring["enabled"] and ring["capacity"] == 100
    by_id = {d["request_id"]: d for d in ring["decisions"]}
    assert set(ids) <= set(by_id)
    for rid in ids:
        decision = by_id[rid]
        assert decision["picked"] == idle.address
        (profile,) = decision["profiles"]
        assert profile["candidates"] == 2
        picked, runner = profile["endpoints"]
        assert picked["picked"] and picked["address"] == idle.address
        assert not runner["picked"] and runner["address"] == busy.address
        # the shown per-scorer weighted scores add up to the totals the picker compared
        for e in (picked, runner):
            assert abs(_weighted_sum(e) - e["total"]) < 1e-3
        assert picked["total"] > runner["total"]
        assert picked["scores"]["prefix-spread-scorer"] > runner["scores"]["prefix-spread-scorer"]
        assert "prompt" not in json.dumps(decision) and "hello there" not in json.dumps(decision)

    # the sampled log line (rate 1: every decision) says the same
    logged = {
        e["request_id"]: e for e in _json_lines(epp.child.log_path) if e.get("event") == "request.decision"
    }
    for rid in ids:
        assert logged[rid]["picked"] == idle.address
        assert logged[rid]["profiles"] == by_id[rid]["profiles"]

    # Envoy's access log carries the epp.decision metadata
    deadline = time.monotonic() + 10
    while True:
        access = {e.get("request_id"): e for e in _json_lines(envoy.child.log_path) if "epp_decision" in e}
        if set(ids) <= set(access) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for resp, rid in zip(responses, ids, strict=True):
        assert access[rid]["epp_decision"] == resp.headers["x-epp-decision"]

    # epp explain prints the ring
    capsys.readouterr()
    assert main(["explain", f"http://127.0.0.1:{epp.metrics_port}"]) == 0
    out = capsys.readouterr().out
    assert ids[-1] in out and busy.address in out
    total = by_id[ids[-1]]["profiles"][0]["endpoints"][0]["total"]
    assert re.search(rf"^\s*\*\s+{re.escape(idle.address)} \(idle-1\)\s+{total:.3f}\s", out, re.M)
