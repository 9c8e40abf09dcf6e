"""Prefill/decode disaggregation against the same endpoints aggregated (``make bench-pd``).

Three simulators, Envoy and the EPP (each run on a fresh stack):

- ``aggregated``: three ``epp sim`` serving prefill and decode, scheduled by prefix affinity and
  queue depth (the P/D config's scorers, no P/D);
- ``pd``: ``epp run --pd``'s stack: one prefill simulator, two decode simulators each behind an
  ``epp pd-sidecar`` (nixlv2), the P/D example config with the decider's threshold ``--threshold``
  (uncached prompt tokens from which a request is prefilled remotely);
- ``pd-2p1d``: the same with two prefill simulators and one decode simulator.

Workloads (open loop, Poisson arrivals, streaming chat, every prompt distinct so nothing is cached):
``long-short`` (long prompts, short answers: what P/D is for), ``mixed`` (half long prompts with
short answers, half short prompts with long answers) and ``short-long`` (short prompts, long
answers: under the threshold, so P/D serves them decode-only on two of the three simulators).

Per run: TTFT and ITL (per request: (latency - TTFT) / (output tokens - 1)) p50 and p90, throughput
(requests and output tokens per second of wall time), and, for ``pd``, how many requests the sidecars
prefilled remotely and how many they served decode-only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _loadgen
from bench._workdir import run_in_workdir
from epp.dev import stack
from epp.dev.stack.pd import PDStack, free_ports_except, pd_config
from tests.integration.harness import request

MODEL = "demo"
# An engine whose prefill costs (0.2 ms a prompt token: a 3000-token prompt takes 0.6 s) and whose
# decode slows as the batch grows (time-factor-under-load), 8 requests at a time.
SIM_ARGS = [
    "--max-num-seqs",
    "8",
    "--time-to-first-token",
    "5",
    "--prefill-time-per-token",
    "0.2",
    "--inter-token-latency",
    "10",
    "--time-factor-under-load",
    "1.0",
]
LONG_CHARS = 12_000
SHORT_CHARS = 80
WORKLOADS = ("long-short", "mixed", "short-long")
RUNS = ("aggregated", "pd", "pd-2p1d")


def aggregated_config() -> dict[str, Any]:
    """The P/D config's scoring without P/D: one profile over every endpoint."""
    return {
        "apiVersion": "llm-d.ai/v1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "approx-prefix-cache-producer"},
            {"type": "prefix-cache-scorer"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "max-score-picker"},
                    {"pluginRef": "prefix-cache-scorer", "weight": 2},
                    {"pluginRef": "queue-scorer", "weight": 1},
                ],
            }
        ],
    }


def plan(workload: str, *, requests: int, rate: float, seed: int) -> list[_loadgen.Planned]:
    rng = random.Random(f"pd-{workload}-{seed}")
    items: list[_loadgen.Planned] = []
    at = 0.0
    for i in range(requests):
        long_prompt = workload == "long-short" or (workload == "mixed" and i % 2 == 0)
        chars = LONG_CHARS if long_prompt else SHORT_CHARS
        text = f"Request {i} {rng.getrandbits(64):016x}. " + _loadgen.system_prompt(i, chars, seed)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 16 if long_prompt else 128,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        items.append(_loadgen.Planned(i, int(long_prompt), at, json.dumps(body).encode()))
        at += rng.expovariate(rate)
    return items


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _metric(port: int, name: str) -> float:
    text = request(f"http://127.0.0.1:{port}/metrics").body.decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#") and line.split("{")[0].split(" ")[0] == name
    )


def run_one(run: str, workload: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    if run.startswith("pd"):
        prefill = 2 if run == "pd-2p1d" else 1
        opts = stack.StackOptions.on_free_ports(
            3, config=pd_config(args.threshold), sim_args=SIM_ARGS, epp_args=["--log-level", "warning"]
        )
        st: stack.LocalStack = PDStack(
            opts,
            workdir,
            prefill_sims=prefill,
            sidecar_ports=free_ports_except(3 - prefill, set(opts.all_ports())),
        )
    else:
        opts = stack.StackOptions.on_free_ports(
            3, config=aggregated_config(), sim_args=SIM_ARGS, epp_args=["--log-level", "warning"]
        )
        st = stack.LocalStack(opts, workdir)
    items = plan(workload, requests=args.requests, rate=args.rate, seed=args.seed)
    with st:
        result = asyncio.run(_loadgen.run([st.url], items, timeout=120, connections=256))
        prefilled = decode_only = 0
        if isinstance(st, PDStack):
            for d in st.decoders:
                handled = _metric(d.metrics_port, "llm_d_disagg_sidecar_requests_total")
                remote = _metric(d.metrics_port, "llm_d_disagg_sidecar_prefilled_requests_total")
                prefilled += int(remote)
                decode_only += int(handled - remote)
    records = result["requests"]
    ok = [r for r in records if not r["error"] and r["ttft"] is not None]
    ttfts = [r["ttft"] * 1000 for r in ok]
    itls = [
        (r["latency"] - r["ttft"]) * 1000 / (r["output_tokens"] - 1)
        for r in ok
        if r["output_tokens"] > 1 and r["latency"] is not None
    ]
    wall = result["wall_seconds"]
    return {
        "run": run,
        "workload": workload,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "ttft_p50_ms": _pct(ttfts, 0.5),
        "ttft_p90_ms": _pct(ttfts, 0.9),
        "itl_p50_ms": _pct(itls, 0.5),
        "itl_p90_ms": _pct(itls, 0.9),
        "req_per_s": len(ok) / wall,
        "tokens_per_s": sum(r["output_tokens"] for r in ok) / wall,
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else 0.0,
        "prefilled": prefilled if run != "aggregated" else None,
        "decode_only": decode_only if run != "aggregated" else None,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | run | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) | ITL p90 (ms) | req/s | "
        "tokens/s | prefilled / decode-only | failed |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        split = "—" if r["prefilled"] is None else f"{r['prefilled']} / {r['decode_only']}"
        lines.append(
            f"| {r['workload']} | {r['run']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | {r['req_per_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {split} | {r['failed']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--requests", type=int, default=60, help="requests per run (default %(default)s)")
    parser.add_argument("--rate", type=float, default=5.0, help="arrivals per second (default %(default)s)")
    parser.add_argument(
        "--threshold", type=int, default=256, help="the decider's nonCachedTokens (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    rows: list[dict[str, Any]] = []

    def run() -> int:
        for workload in args.workloads:
            for name in args.runs:
                print(f"{workload} / {name} ...", file=sys.stderr, flush=True)
                rows.append(run_one(name, workload, args, workdir / f"{workload}-{name}"))
        return 0

    def report() -> None:
        print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))

    return run_in_workdir(
        workdir, run, errors=(RuntimeError, TimeoutError, OSError), keep_logs=args.keep_logs, report=report
    )


if __name__ == "__main__":
    raise SystemExit(main())
