"""The response side of the Envoy exchange, through the real stack (Envoy + ``epp serve`` + slow sims).

* In-flight accounting covers the whole response: during a multi-second streamed generation the
  running-requests gauge and the endpoint's in-flight count (seen through an
  ``active-request-scorer`` that steers new requests away from the busy endpoint) are above 0, they
  return to 0 afterwards, and the duration metric covers the whole generation; for every shipped
  bootstrap variant (both body modes, fail-closed and fail-open, the standalone TLS sidecar).
* A client disconnect mid-generation releases the request at once.
* A frozen (SIGSTOPped) EPP fails requests within a bound (fail-closed) or lets the fallback serve
  them (fail-open), while a healthy EPP lets a generation stream far longer than those bounds.
* A model rewrite (client header) is undone in the response's ``model`` through every bootstrap
  (BUFFERED: mode override; FULL_DUPLEX_STREAMED: the second ext_proc filter, opened only for
  rewritten requests); ``--allow-model-rewrite-header=false`` ignores the header.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from epp.dev.envoy import bootstrap as envoy_config
from tests.integration.harness import MODEL, Envoy, Epp, Rig, Sim

# Slow sims: 100 ms between output tokens, so max_tokens sets the length of a generation.
SLOW_SIM_ARGS = (
    "--time-to-first-token",
    "0",
    "--prefill-time-per-token",
    "0",
    "--inter-token-latency",
    "100",
)
LONG_TOKENS = 40  # ~4 s of streaming
ACTIVE_REQUEST_CONFIG: dict[str, Any] = {
    "plugins": [{"type": "active-request-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [{"pluginRef": "active-request-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
}
SHORT_REQUESTS = 8  # while the long one streams, each must avoid its endpoint (random: 2^-8)
RUNNING = "inference_objective_running_requests"
DURATION_SUM = "inference_objective_request_duration_seconds_sum"

# (body mode, fail-open, standalone sidecar: TLS to the EPP + access log)
VARIANTS = [
    pytest.param("FULL_DUPLEX_STREAMED", False, False, id="full-duplex"),
    pytest.param("BUFFERED", False, False, id="buffered"),
    pytest.param("FULL_DUPLEX_STREAMED", True, False, id="full-duplex-fail-open"),
    pytest.param("BUFFERED", True, False, id="buffered-fail-open"),
    pytest.param("FULL_DUPLEX_STREAMED", False, True, id="standalone-sidecar"),
]


def start_slow_sims(rig: Rig, count: int, *, extra: tuple[str, ...] = ()) -> list[Sim]:
    started = [rig.add_sim(f"slow-{len(rig.sims)}", [*SLOW_SIM_ARGS, *extra]) for _ in range(count)]
    for sim in started:
        rig.stack.wait_sim(sim.child, sim.url)
    return started


def metric(epp: Epp, name: str) -> float:
    """Sum of a metric's samples for the test model (0 when absent)."""
    total = 0.0
    for line in epp.metrics().splitlines():
        if line.startswith(name + "{") and f'model_name="{MODEL}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def poll(what: str, check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Stream:
    """A streamed chat completion read on a thread: when its first and last bytes came, who served it."""

    port: int | None = None
    status: int = 0
    first_byte: float = 0.0
    last_byte: float = 0.0
    body: bytes = b""
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def start_stream(envoy: Envoy, tokens: int, headers: dict[str, str] | None = None) -> Stream:
    out = Stream()

    def run() -> None:
        try:
            body = json.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"long {time.monotonic_ns()}"}],
                    "stream": True,
                    "max_tokens": tokens,
                }
            ).encode()
            conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=300)
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=body,
                headers={"content-type": "application/json", **(headers or {})},
            )
            resp = conn.getresponse()
            out.status = resp.status
            port = resp.getheader("x-inference-port")
            out.port = int(port) if port else None
            first = resp.read1(65536)
            out.first_byte = time.monotonic()
            out.started.set()
            rest = resp.read()
            out.last_byte = time.monotonic()
            out.body = first + rest
            conn.close()
        except BaseException as e:  # reported by the test
            out.error = e
        finally:
            out.started.set()
            out.done.set()

    threading.Thread(target=run, daemon=True).start()
    return out


def short_request(envoy: Envoy) -> int | None:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"short {time.monotonic_ns()}"}],
            "max_tokens": 1,
        }
    ).encode()
    resp = envoy.post("/v1/chat/completions", body)
    assert resp.status == 200, resp
    return resp.port


def _start(rig: Rig, body_mode: str, fail_open: bool, sidecar: bool) -> tuple[list[Sim], Epp, Envoy]:
    sims = start_slow_sims(rig, 2)
    extra = ["--secure-serving=true"] if sidecar else []
    epp = rig.start_epp(sims, config=ACTIVE_REQUEST_CONFIG, extra=extra)
    bootstrap: dict[str, Any] = {"tls": True, "access_log": True} if sidecar else {}
    envoy = rig.start_envoy(epp, body_mode=body_mode, fail_open=fail_open, fallback=sims, **bootstrap)
    return sims, epp, envoy


@pytest.mark.parametrize(("body_mode", "fail_open", "sidecar"), VARIANTS)
def test_in_flight_accounting_covers_the_whole_streamed_generation(
    rig: Rig, body_mode: str, fail_open: bool, sidecar: bool
) -> None:
    sims, epp, envoy = _start(rig, body_mode, fail_open, sidecar)
    assert metric(epp, RUNNING) == 0
    duration_before = metric(epp, DURATION_SUM)

    long = start_stream(envoy, LONG_TOKENS)
    assert long.started.wait(60), "no first byte"
    assert long.error is None, long.error
    assert long.status == 200 and long.port in {s.port for s in sims}

    # Mid-generation: the request is still running, and its endpoint still counts it.
    assert not long.done.is_set(), "the generation ended too early for the test"
    assert metric(epp, RUNNING) >= 1, "running-requests gauge is 0 during a streamed generation"
    others = [short_request(envoy) for _ in range(SHORT_REQUESTS)]
    assert not long.done.is_set(), "the generation ended before the probes: make it longer"
    assert long.port not in others, (
        f"new requests went to the endpoint still streaming ({long.port}): its in-flight count was "
        f"released early; picks {others}"
    )

    assert long.done.wait(120), "the generation never ended"
    assert long.error is None, long.error
    assert long.body.rstrip().endswith(b"data: [DONE]"), long.body[-200:]
    poll("running-requests gauge back to 0", lambda: metric(epp, RUNNING) == 0)
    # The duration metric covers the whole generation, not the time to the first byte.
    streamed = long.last_byte - long.first_byte
    poll(
        "duration metric of the long request",
        lambda: metric(epp, DURATION_SUM) - duration_before >= streamed,
        timeout=10,
    )
    # And the endpoint's count is back to 0: with both idle, picks spread over both again.
    seen: set[int | None] = set()
    for _ in range(40):
        seen.add(short_request(envoy))
        if len(seen) == 2:
            break
    assert seen == {s.port for s in sims}, f"after the generation, picks stick to {seen}"


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_a_client_disconnect_mid_generation_releases_the_request(rig: Rig, body_mode: str) -> None:
    sims = start_slow_sims(rig, 1)
    epp = rig.start_epp(sims)
    envoy = rig.start_envoy(epp, body_mode=body_mode)
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "bye"}], "stream": True, "max_tokens": 600}
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(65536)
    poll("the request counted as running", lambda: metric(epp, RUNNING) == 1)
    conn.sock.shutdown(2)  # the client goes away a minute before the generation would end
    conn.close()
    poll("running-requests gauge back to 0 after the disconnect", lambda: metric(epp, RUNNING) == 0)


# ------------------------------------------------------------------------------ frozen EPP bounds

FROZEN_BOUND = 30.0  # generous under load; the configured bounds are a few seconds


def _freeze(epp: Epp) -> None:
    os.killpg(epp.child.pid, signal.SIGSTOP)


def _thaw(epp: Epp) -> None:
    os.killpg(epp.child.pid, signal.SIGCONT)


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_frozen_epp_fails_closed_promptly(rig: Rig, body_mode: str) -> None:
    sims = start_slow_sims(rig, 1)
    epp = rig.start_epp(sims)
    envoy = rig.start_envoy(epp, body_mode=body_mode)
    assert short_request(envoy) == sims[0].port
    _freeze(epp)
    try:
        t0 = time.monotonic()
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        try:
            resp = envoy.post("/v1/chat/completions", body.encode())
            status: int | str = resp.status
        except (TimeoutError, OSError) as e:  # the client's own timeout: the request hung
            status = f"no answer: {e!r}"
        elapsed = time.monotonic() - t0
        assert isinstance(status, int) and 500 <= status < 600, status
        assert elapsed < FROZEN_BOUND, f"answered only after {elapsed:.1f} s"
    finally:
        _thaw(epp)


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_frozen_epp_fails_open_to_the_fallback(rig: Rig, body_mode: str) -> None:
    sims = start_slow_sims(rig, 1)
    epp = rig.start_epp(sims)
    envoy = rig.start_envoy(epp, body_mode=body_mode, fail_open=True, fallback=sims)
    _freeze(epp)
    try:
        # Once Envoy has noticed (health check, PING timeout), requests are served by the fallback.
        deadline = time.monotonic() + FROZEN_BOUND
        while True:
            body = json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            )
            try:
                resp = envoy.post("/v1/chat/completions", body.encode())
                if resp.status == 200 and resp.port == sims[0].port:
                    break
            except (TimeoutError, OSError):
                pass
            assert time.monotonic() < deadline, "the fallback never served while the EPP was frozen"
            time.sleep(0.2)
    finally:
        _thaw(epp)


def test_a_generation_outlives_the_frozen_epp_bounds(rig: Rig) -> None:
    """A healthy EPP keeps a generation streaming well past message timeout and PING bounds."""
    sims = start_slow_sims(rig, 1)
    epp = rig.start_epp(sims)
    envoy = rig.start_envoy(epp, body_mode="FULL_DUPLEX_STREAMED")
    bounds = _seconds(envoy_config.MESSAGE_TIMEOUT) + sum(
        _seconds(v) for v in envoy_config.EXTPROC_KEEPALIVE.values()
    )
    tokens = int(bounds * 2 / 0.1) + 10  # at 100 ms a token: twice the bounds
    long = start_stream(envoy, tokens)
    assert long.done.wait(tokens * 0.1 * 4 + 60), "the generation never ended"
    assert long.error is None, long.error
    assert long.status == 200
    assert long.last_byte - long.first_byte > bounds
    assert long.body.rstrip().endswith(b"data: [DONE]"), long.body[-200:]
    chunks = [c for c in long.body.split(b"\n\n") if c.startswith(b"data: {")]
    assert len(chunks) >= tokens, len(chunks)
    poll("running-requests gauge back to 0", lambda: metric(epp, RUNNING) == 0)


def _seconds(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)s", value)
    assert m, value
    return float(m[1])


# --------------------------------------------------------------------------- model-name rewrites

TARGET = "demo-v2"


@pytest.fixture(scope="module")
def rewrite_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.integration.harness import require_envoy

    require_envoy()
    rig = Rig(tmp_path_factory.mktemp("rewrite") / "logs")
    try:
        sims = start_slow_sims(rig, 1, extra=("--served-model-name", TARGET))
        honour = rig.start_epp(sims, name="epp-honour")
        ignore = rig.start_epp(sims, name="epp-ignore", extra=["--allow-model-rewrite-header=false"])
        envoys = {
            (mode, "honour" if not fail_open else "fail-open"): rig.start_envoy(
                honour,
                body_mode=mode,
                fail_open=fail_open,
                fallback=sims,
                name=f"envoy-{mode.lower()}-{'open' if fail_open else 'closed'}",
            )
            for mode in ("FULL_DUPLEX_STREAMED", "BUFFERED")
            for fail_open in (False, True)
        }
        tls = rig.start_epp(sims, name="epp-tls", extra=["--secure-serving=true"])
        envoys[("FULL_DUPLEX_STREAMED", "sidecar")] = rig.start_envoy(
            tls, name="envoy-sidecar", tls=True, access_log=True
        )
        envoys[("FULL_DUPLEX_STREAMED", "ignore")] = rig.start_envoy(
            ignore, body_mode="FULL_DUPLEX_STREAMED", name="envoy-ignore"
        )
        yield {"sim": sims[0], "envoys": envoys, "rig": rig}
    finally:
        rig.close()


def _chat(
    envoy: Envoy, marker: str, *, stream: bool, headers: dict[str, str]
) -> tuple[int, list[str], bytes]:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": marker}], "stream": stream, "max_tokens": 3}
    ).encode()
    resp = envoy.post("/v1/chat/completions", body, headers)
    if stream:
        chunks = [c[len(b"data: ") :] for c in resp.body.split(b"\n\n") if c.startswith(b"data: {")]
        models = [json.loads(c)["model"] for c in chunks]
    else:
        models = [resp.json()["model"]] if resp.status == 200 else []
    return resp.status, models, resp.body


@pytest.mark.parametrize(
    ("body_mode", "failure"),
    [
        ("FULL_DUPLEX_STREAMED", "honour"),
        ("BUFFERED", "honour"),
        ("FULL_DUPLEX_STREAMED", "fail-open"),
        ("BUFFERED", "fail-open"),
        ("FULL_DUPLEX_STREAMED", "sidecar"),
    ],
    ids=["full-duplex", "buffered", "full-duplex-fail-open", "buffered-fail-open", "standalone-sidecar"],
)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("header", ["x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"])
def test_a_rewritten_model_is_reversed_in_the_response(
    rewrite_stack: dict[str, Any], body_mode: str, failure: str, stream: bool, header: str
) -> None:
    sim: Sim = rewrite_stack["sim"]
    envoy: Envoy = rewrite_stack["envoys"][(body_mode, failure)]
    marker = f"rw-{time.monotonic_ns()}"
    status, models, body = _chat(envoy, marker, stream=stream, headers={header: TARGET})
    assert status == 200, body
    seen = sim.find(marker)
    assert seen is not None
    assert json.loads(seen["body"])["model"] == TARGET  # the model server got the target model
    assert header not in seen["headers"]  # and not the client's control header
    assert models and all(m == MODEL for m in models), (models, body[:300])


def test_only_rewritten_requests_open_the_rewrite_stream(rewrite_stack: dict[str, Any]) -> None:
    envoy: Envoy = rewrite_stack["envoys"][("FULL_DUPLEX_STREAMED", "honour")]
    stat = f"http.inference.ext_proc.{envoy_config.REWRITE_STAT_PREFIX}.streams_started"
    before = envoy.stat(stat)
    for stream in (True, False):
        status, models, body = _chat(envoy, "plain", stream=stream, headers={})
        assert status == 200 and models and all(m == MODEL for m in models), body[:300]
    assert envoy.stat(stat) == before
    status, models, body = _chat(envoy, "rw", stream=False, headers={"x-llm-d-model-name-rewrite": TARGET})
    assert status == 200 and models == [MODEL], body[:300]
    assert envoy.stat(stat) == before + 1


def test_the_rewrite_header_can_be_ignored(rewrite_stack: dict[str, Any]) -> None:
    sim: Sim = rewrite_stack["sim"]
    envoy: Envoy = rewrite_stack["envoys"][("FULL_DUPLEX_STREAMED", "ignore")]
    marker = f"ignored-{time.monotonic_ns()}"
    status, models, body = _chat(envoy, marker, stream=False, headers={"x-llm-d-model-name-rewrite": TARGET})
    assert status == 200, body
    seen = sim.find(marker)
    assert seen is not None
    assert json.loads(seen["body"])["model"] == MODEL
    assert "x-llm-d-model-name-rewrite" not in seen["headers"]
    assert models == [MODEL]
