"""How close ``epp sim`` is to a real vLLM (``make sim-fidelity``): the same black-box probes
against both, one table.

Starts one ``epp sim`` (the tiny model's tokenizer, block size 32, KV events) and one vLLM from
``make engines`` (the tiny model, KV events, without ``--enable-scale-out``), or uses the vLLM at
``--vllm-url`` (its KV events on ``--vllm-kv-port``). Probes: the ``vllm:`` metric families and
``cache_config_info``'s labels, how long an idle keep-alive connection stays open, the KV events of
the same prompt, ``/tokenize``, the usage fields, the render endpoint, error bodies, the block-size
rule (vLLM's CPU backend refuses a block size that is not a multiple of 32).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq

from epp.dev import stack
from epp.dev.stack import engines
from epp.kvevents.decode import BlockStored, decode_batch

KEEPALIVE_WAIT = 12.0
_FAMILY = re.compile(r"^# TYPE (vllm:\S+) ")


class Target:
    def __init__(self, name: str, port: int, kv_port: int, model: str) -> None:
        self.name, self.port, self.kv_port, self.model = name, port, kv_port, model

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, body=data, headers={"content-type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()


def families(t: Target) -> tuple[set[str], int]:
    text = t.call("GET", "/metrics")[1]
    fams = {m.group(1) for line in text.splitlines() if (m := _FAMILY.match(line))}
    info = next((line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")), "")
    return fams, info.count("=")


def idle_close(t: Target) -> str:
    """Seconds until the server closes an idle keep-alive connection (after one request)."""
    s = socket.create_connection(("127.0.0.1", t.port), timeout=KEEPALIVE_WAIT + 2)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.recv(65536)
    start = time.monotonic()
    try:
        while s.recv(65536):
            pass
        return f"closed after {time.monotonic() - start:.1f} s"
    except TimeoutError:
        return f"open after {KEEPALIVE_WAIT + 2:.0f} s"
    finally:
        s.close()


def kv_events(t: Target, prompt: str) -> list[BlockStored]:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{t.kv_port}")
    time.sleep(1.0)  # the subscription reaches the publisher
    t.call("POST", "/v1/completions", {"model": t.model, "prompt": prompt, "max_tokens": 1})
    out: list[BlockStored] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sub.poll(200):
            frames = sub.recv_multipart()
            out += [e for e in decode_batch(frames[-1]).events if isinstance(e, BlockStored)]
        elif out:
            break
    sub.close(0)
    return out


def probe(t: Target, prompt: str) -> dict[str, Any]:
    r: dict[str, Any] = {}
    r["families"], r["info_labels"] = families(t)
    r["keepalive"] = idle_close(t)
    r["events"] = kv_events(t, prompt + " and a fresh tail")  # the same prompt, cached by neither
    status, body = t.call("POST", "/tokenize", {"model": t.model, "prompt": prompt})
    r["tokenize"] = json.loads(body).get("tokens") if status == 200 else f"HTTP {status}"
    status, body = t.call("POST", "/v1/completions", {"model": t.model, "prompt": prompt, "max_tokens": 2})
    usage = json.loads(body).get("usage", {}) if status == 200 else {}
    r["usage"] = sorted(usage)
    r["details"] = usage.get("prompt_tokens_details")
    r["render"] = t.call("POST", "/v1/completions/render", {"model": t.model, "prompt": prompt})[0]
    status, body = t.call("POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    r["unknown_model"] = f"{status} {_shape(body)}"
    status, body = t.call("POST", "/v1/completions", raw=b"{not json")
    r["bad_json"] = f"{status} {_shape(body)}"
    return r


def _shape(body: str) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return "(not JSON)"
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return "{error: {" + ", ".join(sorted(doc["error"])) + "}}"
    return "{" + ", ".join(sorted(doc)) + "}" if isinstance(doc, dict) else type(doc).__name__


def block_size_rule(workdir: Path) -> tuple[str, str]:
    """(vLLM, epp sim) started with ``--block-size 16``."""
    port = stack.free_port()
    argv = engines.vllm_argv(port, block_size=16)
    out = subprocess.run(
        argv, env=engines.vllm_env(), capture_output=True, text=True, timeout=300, check=False
    )
    lines = [x for x in (out.stdout + out.stderr).splitlines() if "block" in x.lower() and "32" in x]
    real = f"exit {out.returncode}: {lines[-1].strip()[-90:]}" if lines else f"exit {out.returncode}"
    with stack.Stack(workdir / "bs16") as st:
        p = stack.free_port()
        child = st.start_sim("bs16", p, model=engines.TINY_MODEL_NAME, args=["--block-size", "16"])
        try:
            st.wait_sim(child, f"http://127.0.0.1:{p}")
            sim = "starts and serves"
        except Exception as e:
            sim = f"refused: {e}"[:90]
    return real, sim


def table(
    sim: dict[str, Any], real: dict[str, Any], rule: tuple[str, str] | None
) -> list[tuple[str, str, str]]:
    rows = []
    fs, fr = sim["families"], real["families"]
    rows.append(("vllm: metric families", f"{len(fs)}", f"{len(fr)}"))
    rows.append(("families vLLM has, sim lacks", f"{len(fr - fs)}", ", ".join(sorted(fr - fs))[:300]))
    rows.append(("families sim has, vLLM lacks", ", ".join(sorted(fs - fr)) or "none", ""))
    rows.append(("cache_config_info labels", str(sim["info_labels"]), str(real["info_labels"])))
    rows.append(("idle keep-alive connection", sim["keepalive"], real["keepalive"]))
    es, er = sim["events"], real["events"]
    rows.append(
        (
            "KV events: BlockStored blocks",
            str(sum(len(e.block_hashes) for e in es)),
            str(sum(len(e.block_hashes) for e in er)),
        )
    )
    same_tokens = [e.token_ids for e in es] == [e.token_ids for e in er]
    same_hashes = [e.block_hashes for e in es] == [e.block_hashes for e in er]
    rows.append(
        (
            "KV events: same token ids / hashes",
            f"tokens {'same' if same_tokens else 'differ'}",
            f"hashes {'same' if same_hashes else 'differ'}",
        )
    )
    rows.append(
        (
            "/tokenize of the same prompt",
            "same" if sim["tokenize"] == real["tokenize"] else str(sim["tokenize"])[:60],
            str(real["tokenize"])[:60] if sim["tokenize"] != real["tokenize"] else "same",
        )
    )
    rows.append(("usage fields", ", ".join(sim["usage"]), ", ".join(real["usage"])))
    rows.append(("usage.prompt_tokens_details", json.dumps(sim["details"]), json.dumps(real["details"])))
    rows.append(("render without --enable-scale-out", str(sim["render"]), str(real["render"])))
    rows.append(("unknown model", sim["unknown_model"], real["unknown_model"]))
    rows.append(("malformed JSON body", sim["bad_json"], real["bad_json"]))
    if rule:
        rows.append(("--block-size 16", rule[1], rule[0]))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--vllm-url", default="", help="a running vLLM (http://127.0.0.1:PORT) instead of starting one"
    )
    p.add_argument("--vllm-kv-port", type=int, default=0, help="its KV-event PUB port")
    p.add_argument("--model", default=engines.TINY_MODEL_NAME)
    p.add_argument("--skip-block-size", action="store_true", help="skip the block-size probe (a vLLM start)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.vllm_url and engines.missing():
        print(f"sim-fidelity: {engines.missing()}", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="epp-fidelity-"))
    prompt = "The quick system prompt explains the answer to the user, " * 6
    with stack.Stack(workdir, ready_timeout=900) as st:
        sim_port, sim_kv, sim_replay = stack.free_ports(3)
        sim_args = ["--tokenizer", str(engines.tiny_model()), "--block-size", str(engines.VLLM_BLOCK_SIZE)]
        sim_args += stack.kv_events_sim_args(sim_kv, sim_replay)
        # as the vLLM below: cached-token usage on, render endpoints at their default (off)
        sim_argv = stack.python_argv("sim", "--port", str(sim_port), "--model", args.model, "--name", "sim")
        child = st.supervisor.start("sim", [*sim_argv, "--enable-prompt-tokens-details", *sim_args])
        st.wait_sim(child, f"http://127.0.0.1:{sim_port}")
        if args.vllm_url:
            real = Target(
                "vllm", int(args.vllm_url.rsplit(":", 1)[1].strip("/")), args.vllm_kv_port, args.model
            )
        else:
            port, kv, replay = stack.free_ports(3)
            argv_ = engines.vllm_argv(
                port, kv_pub=kv, kv_replay=replay, served_name=args.model, scale_out=False
            )
            v = st.supervisor.start("vllm", argv_, env=engines.vllm_env())
            st.wait("vLLM /health", stack.http_ok(f"http://127.0.0.1:{port}/health"), children=[v])
            real = Target("vllm", port, kv, args.model)
        sim_r = probe(Target("sim", sim_port, sim_kv, args.model), prompt)
        real_r = probe(real, prompt)
    rule = None if args.skip_block_size or args.vllm_url else block_size_rule(workdir)
    print("| probe | epp sim | vLLM 0.32 (CPU) |\n|---|---|---|")
    for name, a, b in table(sim_r, real_r, rule):
        print(f"| {name} | {a} | {b} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
