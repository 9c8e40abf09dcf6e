"""P/D end to end (``epp run --pd``'s :class:`PDStack`): Envoy, the EPP with the P/D example config,
a prefill simulator, decode simulators each behind an ``epp pd-sidecar``.

A long prompt is prefilled on the prefill simulator (its journal and metrics) and decoded on a decode
one with the transferred KV (``vllm:prompt_tokens_by_source``), streamed or not; a short one is
served decode-only (the decider's threshold); a forged prefill header is refused (403, counted) or
stripped by the EPP; a prefill simulator killed mid-run turns requests decode-only with none failed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epp.dev import stack
from epp.dev.stack.pd import PDStack, free_ports_except, pd_config
from tests.integration.harness import SIM_ARGS, Response, request, require_envoy

pytestmark = pytest.mark.integration

PREFILL_HEADER = "x-prefiller-host-port"
THRESHOLD = 64  # the decider's nonCachedTokens: a long prompt here is ~400 tokens, a short one ~5


@pytest.fixture
def pd(tmp_path: Path) -> Iterator[PDStack]:
    require_envoy()
    opts = stack.StackOptions.on_free_ports(
        3,
        config=pd_config(THRESHOLD),
        sim_args=list(SIM_ARGS),
        epp_args=["--log-level", "warning"],
        sim_max_restarts=0,
    )
    st = PDStack(opts, tmp_path, prefill_sims=1, sidecar_ports=free_ports_except(2, set(opts.all_ports())))
    with st:
        yield st


def chat(text: str, *, stream: bool = False) -> bytes:
    return json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": text}], "stream": stream}
    ).encode()


def long_prompt() -> str:
    return f"{uuid.uuid4().hex} " + "lorem ipsum dolor sit amet " * 80


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return request(
        url + "/v1/chat/completions", "POST", body, {"content-type": "application/json", **(headers or {})}
    )


def journal(port: int) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = request(f"http://127.0.0.1:{port}/debug/requests").json()
    return entries


def find(port: int, text: str) -> dict[str, Any] | None:
    return next((json.loads(e["body"]) for e in journal(port) if text in e["body"]), None)


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with ``labels`` on the /metrics page at ``port``."""
    total = 0.0
    for line in request(f"http://127.0.0.1:{port}/metrics").body.decode().splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def sidecar_metric(st: PDStack, name: str, **labels: str) -> float:
    return sum(metric(d.metrics_port, name, **labels) for d in st.decoders)


EXTERNAL = {"source": "external_kv_transfer"}
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def test_long_prompts_are_prefilled_remotely_short_ones_served_decode_only(pd: PDStack) -> None:
    st = pd
    (prefill_port,) = st.prefill_ports
    engines = {f"{d.name}-engine": d.engine_port for d in st.decoders}
    for stream in (False, True):
        text = long_prompt()
        resp = post(st.url, chat(text, stream=stream))
        assert resp.status == 200, resp
        assert (b"data: [DONE]" in resp.body) is stream
        engine = resp.headers["x-inference-pod"]
        assert engine in engines, "decoded on a decode simulator"
        prefill = find(prefill_port, text)
        assert prefill is not None, "the prefill simulator received the request"
        assert prefill["kv_transfer_params"]["do_remote_decode"] is True
        assert (prefill["max_tokens"], prefill["stream"]) == (1, False)
        decode = find(engines[engine], text)
        assert decode is not None and decode["stream"] is stream
        params = decode["kv_transfer_params"]
        assert params["remote_engine_id"] == "prefill-0" and params["remote_port"] == prefill_port
    # the prefill simulator computed the prompts; the decode ones took them from the transfer
    assert metric(prefill_port, "vllm:prompt_tokens_total") > 2 * THRESHOLD
    assert sum(metric(p, BY_SOURCE, **EXTERNAL) for p in engines.values()) > 2 * THRESHOLD
    assert sidecar_metric(st, "llm_d_disagg_sidecar_prefilled_requests_total") == 2

    # Below the decider's threshold: decode-only, the prefill simulator never sees it.
    short = f"{uuid.uuid4().hex} hi"
    resp = post(st.url, chat(short))
    assert resp.status == 200, resp
    assert find(prefill_port, short) is None
    decode = find(engines[resp.headers["x-inference-pod"]], short)
    assert decode is not None and "kv_transfer_params" not in decode

    # A client's forged prefill header is consumed by the EPP: it never reaches a sidecar.
    forged = f"{uuid.uuid4().hex} hi"
    resp = post(st.url, chat(forged), {PREFILL_HEADER: "169.254.169.254:80"})
    assert resp.status == 200, resp
    assert sidecar_metric(st, "llm_d_disagg_sidecar_ssrf_denied_total") == 0

    # Straight to a sidecar (inside the cluster): a host outside the pool's prefill endpoints is refused.
    sidecar = st.decoders[0]
    for target in ("169.254.169.254:80", f"127.0.0.1:{sidecar.engine_port}", st.decoders[1].address):
        resp = post(f"http://{sidecar.address}", chat(long_prompt()), {PREFILL_HEADER: target})
        assert resp.status == 403, (target, resp)
        assert "SSRF protection" in resp.json()["error"]["message"]
    assert sidecar_metric(st, "llm_d_disagg_sidecar_ssrf_denied_total") == 3
    resp = post(
        f"http://{sidecar.address}", chat(long_prompt()), {PREFILL_HEADER: f"127.0.0.1:{prefill_port}"}
    )
    assert resp.status == 200, resp


def test_a_prefiller_killed_mid_run_turns_requests_decode_only(pd: PDStack) -> None:
    st = pd
    statuses: list[int] = []
    lock = threading.Lock()
    killed = threading.Event()
    total = 40

    def client(n: int) -> None:
        for i in range(n):
            status = post(st.url, chat(long_prompt(), stream=i % 2 == 1)).status
            with lock:
                statuses.append(status)
                if len(statuses) == total // 4 and not killed.is_set():
                    st.sims[0].kill()  # the prefill simulator, SIGKILL, not restarted
                    killed.set()

    threads = [threading.Thread(target=client, args=(total // 4,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert killed.is_set() and not st.sims[0].running()
    assert len(statuses) == total
    assert statuses == [200] * total, "not one request failed"
    assert sidecar_metric(st, "llm_d_disagg_sidecar_prefilled_requests_total") >= total // 4 - 4
    assert sidecar_metric(st, "llm_d_disagg_sidecar_decode_only_fallbacks_total", reason="unreachable") >= 1


def test_epp_run_pd_banner_serves_and_stops(tmp_path: Path) -> None:
    """``epp run --pd`` as a user runs it: the banner says which endpoint does what, a long prompt is
    prefilled on the prefill simulator, Ctrl-C stops everything (exit 0)."""
    require_envoy()
    base = _consecutive_free_ports(5)  # 3 simulators, then the 2 sidecars
    ports = stack.free_ports(5)
    while set(ports) & set(range(base, base + 5)):
        ports = stack.free_ports(5)
    flags = ("--port", "--admin-port", "--grpc-port", "--grpc-health-port", "--metrics-port")
    argv = [sys.executable, "-m", "epp", "run", "--pd", "--sim-base-port", str(base)]
    argv += ["--sim-arg", "--time-to-first-token=0", "--sim-arg", "--max-tokens=4"]
    for flag, port in zip(flags, ports, strict=True):
        argv += [flag, str(port)]
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 90
            while "Prefill/decode disaggregation:" not in out.read_text():
                assert proc.poll() is None, out.read_text()
                assert time.monotonic() < deadline, out.read_text()
                time.sleep(0.2)
            time.sleep(0.3)  # the roles' lines follow the heading
            banner = out.read_text()
            assert f"prefill    prefill-0  127.0.0.1:{base}  (epp sim --role prefill)" in banner
            assert f"decode     decode-0  127.0.0.1:{base + 3}  (epp pd-sidecar" in banner
            assert f"-> epp sim --role decode on 127.0.0.1:{base + 1}" in banner
            text = long_prompt() * 2  # over the example's nonCachedTokens (256)
            resp = post(f"http://127.0.0.1:{ports[0]}", chat(text))
            assert resp.status == 200, resp
            assert resp.headers["x-inference-pod"].startswith("decode-")
            assert find(base, text) is not None, "prefilled on the prefill simulator"
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(30)
    assert code == 0, out.read_text()
    assert not any(stack.port_in_use(p) for p in (base, base + 3, ports[0])), "everything stopped"


def _consecutive_free_ports(count: int) -> int:
    for _ in range(50):
        base = stack.free_port()
        if base + count < 65536 and not any(stack.port_in_use(base + i) for i in range(count)):
            return base
    raise RuntimeError("no block of free ports")
