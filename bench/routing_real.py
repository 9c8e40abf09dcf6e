"""Routing measured on real vLLM engines (``make bench-routing-real``), the simulator beside them.

Three vLLM engines from ``make engines`` (the tiny model, small KV caches, prefix caching, KV
events) behind the EPP and Envoy; multi-turn conversations whose sessions share a few long system
prompts, with think times (idle gaps past vLLM's 5 s keep-alive among them). Per scheduling config
(random, default, precise) a fresh EPP and Envoy over the same engines, their prefix caches reset
first (``/reset_prefix_cache``, vLLM's dev mode): the hit rate as vLLM counts it
(``prefix_cache_hits_total / prefix_cache_queries_total``), TTFT p50/p90, failures. Then the same
workload over three ``epp sim`` with the same tokenizer, block size and KV capacity: the
simulator's hit rate for the same configs. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.routing import ROUND_ROBIN_CONFIG, counter_sum, percentile
from epp.dev import stack
from epp.dev.envoy.bootstrap import envoy_bootstrap
from epp.dev.stack import engines
from epp.dev.stack.files import vllm_engines_config

LOADGEN = Path(__file__).with_name("_loadgen.py")
ENGINES = 3
KV_BLOCKS = 384  # 12,288 tokens of KV cache per engine: about three conversations' worth
MAX_MODEL_LEN = 8192
ENGINE_READY = 900.0


def configs(tokenizer: str) -> dict[str, dict[str, Any] | None]:
    return {
        "random": ROUND_ROBIN_CONFIG,
        "default": None,
        "precise": vllm_engines_config(tokenizer, engines.VLLM_BLOCK_SIZE),
    }


def _post(url: str) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(resp.status)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def cache_counters(ports: list[int]) -> tuple[float, float]:
    hits = queries = 0.0
    for port in ports:
        text = _get(f"http://127.0.0.1:{port}/metrics")
        hits += counter_sum(text, "vllm:prefix_cache_hits_total")
        queries += counter_sum(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def loadgen(url: str, args: argparse.Namespace, output: Path, model: str) -> dict[str, Any]:
    argv = [
        sys.executable,
        str(LOADGEN),
        "--url",
        url,
        "--scenario",
        "sessions",
        "--model",
        model,
        "--sessions",
        str(args.sessions),
        "--turns",
        str(args.turns),
        "--system-groups",
        str(args.groups),
        "--prompt-chars",
        str(args.prompt_chars),
        "--turn-chars",
        str(args.turn_chars),
        "--think-time",
        str(args.think_time),
        "--rate",
        str(args.rate),
        "--max-tokens",
        str(args.max_tokens),
        "--seed",
        str(args.seed),
        "--timeout",
        "300",
        "--output",
        str(output),
    ]
    subprocess.run(argv, check=True)
    return dict(json.loads(output.read_text()))


def front(
    st: stack.Stack, workdir: Path, label: str, ports: list[int], kv: list[tuple[int, int]], config: Any
) -> str:
    """An EPP (file discovery over the engines on ``ports``) and its Envoy; their URL."""
    names = [f"engine-{i}" for i in range(len(ports))]
    labels = {n: stack.kv_events_labels(*k) for n, k in zip(names, kv, strict=True) if k[0]}
    endpoints = workdir / f"{label}-endpoints.yaml"
    stack.write_endpoints(endpoints, ports, names=names, labels=labels)
    grpc, health, metrics, port, admin = stack.free_ports(5)
    epp = st.start_epp(
        f"epp-{label}",
        grpc_port=grpc,
        health_port=health,
        metrics_port=metrics,
        config=stack.epp_config(endpoints, config),
        extra=["--log-level", "warning"],
    )
    st.wait_epp(epp, health)
    bootstrap = envoy_bootstrap(listen_port=port, admin_port=admin, extproc_port=grpc)
    envoy = st.start_envoy(f"envoy-{label}", bootstrap)
    st.wait_envoy(envoy, admin)
    url = f"http://127.0.0.1:{port}"
    st.wait(f"{label}: /v1/models through Envoy", stack.http_ok(f"{url}/v1/models"), children=[epp, envoy])
    return url


def summarize(label: str, kind: str, data: dict[str, Any], hits: float, queries: float) -> dict[str, Any]:
    recs = data["requests"]
    ok = [r for r in recs if not r["error"]]
    ttft = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
    return {
        "engines": kind,
        "config": label,
        "requests": len(recs),
        "failed": len(recs) - len(ok),
        "first_error": next((r["error"] for r in recs if r["error"]), ""),
        "hit_rate": hits / queries if queries else None,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "wall_s": data["wall_seconds"],
    }


def run_real(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    env = {**engines.vllm_env(), "VLLM_SERVER_DEV_MODE": "1"}
    with stack.Stack(workdir, ready_timeout=ENGINE_READY) as st:
        ports = stack.free_ports(3 * ENGINES)
        api, kv = (
            ports[:ENGINES],
            [(ports[ENGINES + 2 * i], ports[ENGINES + 2 * i + 1]) for i in range(ENGINES)],
        )
        children = []
        for i, port in enumerate(api):
            argv = engines.vllm_argv(
                port, kv_pub=kv[i][0], kv_replay=kv[i][1], num_blocks=KV_BLOCKS, max_model_len=MAX_MODEL_LEN
            )
            children.append(st.supervisor.start(f"vllm-{i}", argv, env=env))
        started = time.monotonic()
        for child, port in zip(children, api, strict=True):
            st.wait(
                f"{child.name} /health", stack.http_ok(f"http://127.0.0.1:{port}/health"), children=[child]
            )
        print(f"{ENGINES} vLLM engines up in {time.monotonic() - started:.0f} s", flush=True)
        for label, config in configs(str(engines.tiny_model())).items():
            if args.configs and label not in args.configs:
                continue
            for port in api:
                _post(f"http://127.0.0.1:{port}/reset_prefix_cache")
            url = front(st, workdir, label, api, kv, config)
            h0, q0 = cache_counters(api)
            data = loadgen(url, args, workdir / f"real-{label}.json", engines.TINY_MODEL_NAME)
            h1, q1 = cache_counters(api)
            rows.append(summarize(label, "vLLM", data, h1 - h0, q1 - q0))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_sim(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    tokenizer = str(engines.tiny_model())
    sim_args = [
        "--tokenizer",
        tokenizer,
        "--block-size",
        str(engines.VLLM_BLOCK_SIZE),
        "--kv-cache-size",
        str(KV_BLOCKS),
        "--max-tokens",
        str(args.max_tokens),
    ]
    for label, config in configs(tokenizer).items():
        if args.configs and label not in args.configs:
            continue
        sub = workdir / f"sim-{label}"
        sub.mkdir()
        with stack.Stack(sub) as st:
            ports = stack.free_ports(3 * ENGINES)
            api, kv = (
                ports[:ENGINES],
                [(ports[ENGINES + 2 * i], ports[ENGINES + 2 * i + 1]) for i in range(ENGINES)],
            )
            for i, port in enumerate(api):
                child = st.start_sim(
                    f"sim-{i}",
                    port,
                    model=engines.TINY_MODEL_NAME,
                    args=[*sim_args, *stack.kv_events_sim_args(*kv[i])],
                )
                st.wait_sim(child, f"http://127.0.0.1:{port}")
            url = front(st, sub, label, api, kv, config)
            h0, q0 = cache_counters(api)
            data = loadgen(url, args, sub / "load.json", engines.TINY_MODEL_NAME)
            h1, q1 = cache_counters(api)
            rows.append(summarize(label, "epp sim", data, h1 - h0, q1 - q0))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| engines | config | requests | failed | hit rate (vLLM's counters) | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = "—" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        print(
            f"| {r['engines']} | {r['config']} | {r['requests']} | {r['failed']} | {rate} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} |"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--sessions", type=int, default=104, help="conversations (default 104)")
    add("--turns", type=int, default=5, help="turns per conversation (default 5)")
    add("--groups", type=int, default=8, help="system prompts the sessions share (default 8)")
    add("--prompt-chars", type=int, default=1500, help="system prompt length in characters (1500)")
    add("--turn-chars", type=int, default=200, help="user message length in characters (200)")
    add("--think-time", type=float, default=2.5, help="mean think time in s between turns (2.5)")
    add("--rate", type=float, default=1.5, help="conversations started per second (1.5)")
    add("--max-tokens", type=int, default=8, help="max_tokens per request (8)")
    add("--seed", type=int, default=1)
    add("--configs", nargs="*", default=[], help="only these configs (random, default, precise)")
    add("--no-sim", action="store_true", help="skip the simulator runs")
    add("--json", default="", help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    why = engines.missing()
    if why:
        print(f"bench-routing-real: {why}", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-real-"))
    print(f"work dir {workdir}", flush=True)
    rows = run_real(args, workdir)
    if not args.no_sim:
        rows += run_sim(args, workdir)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
