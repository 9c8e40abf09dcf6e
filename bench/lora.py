"""Many-LoRA bench: adapter loads per minute and TTFT of a Zipf adapter workload, per configuration.

``epp run``'s stack (simulators + ``epp serve`` + Envoy) for each configuration, fresh simulators
each time: ``affinity`` (``lora-affinity-scorer`` x2 + queue + kv-cache scorers, the reference's LoRA
routing) and ``residency`` (the shipped ``deploy/examples/lora-at-scale.yaml``: ``lora-residency-filter``
+ ``lora-load-state-scorer`` x2 + queue + kv-cache). Every simulator serves the same adapters with few
GPU slots and a host cache; an adapter load costs ``--lora-load-time`` cold, ``--lora-host-load-time``
from the host cache. Open loop: streaming completions at Poisson times, adapters drawn with Zipf
popularity (seeded). Loads are the simulators' own count (``vllm:lora_adapter_load_seconds_count``);
TTFT is measured by the client to the first streamed chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._workdir import run_in_workdir
from epp.dev import stack

MODEL = "demo"
EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "lora-at-scale.yaml"
READY_TIMEOUT = 120.0
AFFINITY: dict[str, Any] = stack.one_profile_config(
    [
        {"type": "lora-affinity-scorer"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
    {
        "lora-affinity-scorer": 2,
        "queue-scorer": 1,
        "kv-cache-utilization-scorer": 1,
        "max-score-picker": None,
    },
)


def configs() -> dict[str, dict[str, Any]]:
    residency: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return {"affinity": AFFINITY, "residency": residency}


@dataclass
class Result:
    label: str
    requests: int
    errors: int
    wall: float
    loads: int
    ttft_ms: list[float] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)

    @property
    def loads_per_minute(self) -> float:
        return self.loads / self.wall * 60.0 if self.wall > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def workload(args: argparse.Namespace) -> list[tuple[float, str]]:
    """``(start offset in s, adapter)`` per request: Poisson arrivals, Zipf popularity."""
    rng = random.Random(args.seed)
    adapters = [f"adapter-{i}" for i in range(args.adapters)]
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(args.adapters)]
    t = 0.0
    out = []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append((t, rng.choices(adapters, weights=weights)[0]))
    return out


def sim_args(args: argparse.Namespace) -> list[str]:
    return [
        "--lora-modules",
        *(f"adapter-{i}" for i in range(args.adapters)),
        "--max-loras",
        str(args.max_loras),
        "--max-cpu-loras",
        str(args.max_cpu_loras),
        "--lora-load-time",
        str(args.lora_load_time),
        "--lora-host-load-time",
        str(args.lora_host_load_time),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--time-to-first-token",
        "15",
        "--inter-token-latency",
        "4",
        "--max-tokens",
        str(args.max_tokens),
        *shlex.split(args.sim_args),
    ]


def loads(ports: list[int]) -> int:
    total = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        match = re.search(r"^vllm:lora_adapter_load_seconds_count\{[^}]*\} (\S+)$", text, re.M)
        total += float(match.group(1)) if match else 0.0
    return int(total)


DECISIONS = re.compile(
    r"^llm_d_router_endpoint_picker_lora_residency_filter_decisions_total"
    r'\{[^}]*outcome="([a-z_]+)"[^}]*\} (\S+)$',
    re.M,
)


def decisions(metrics_port: int) -> dict[str, int]:
    """The EPP's ``lora-residency-filter`` decisions by outcome (empty without the filter)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {outcome: int(float(value)) for outcome, value in DECISIONS.findall(text) if float(value) > 0}


async def _one(url: str, adapter: str, i: int, max_tokens: int) -> float | None:
    """TTFT in ms of one streaming completion, None on an error."""
    body = json.dumps(
        {"model": adapter, "prompt": f"request {i} about {adapter}", "max_tokens": max_tokens, "stream": True}
    ).encode()
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            writer.close()
            return None
        ttft: float | None = None
        while True:
            line = await reader.readline()
            if not line:
                break
            if ttft is None and line.startswith(b"data: {"):
                ttft = (time.monotonic() - t0) * 1000.0
        writer.close()
        return ttft
    except OSError:
        return None


async def _drive(url: str, plan: list[tuple[float, str]], max_tokens: int) -> list[float | None]:
    start = time.monotonic()

    async def at(offset: float, adapter: str, i: int) -> float | None:
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        return await _one(url, adapter, i, max_tokens)

    return list(await asyncio.gather(*(at(o, a, i) for i, (o, a) in enumerate(plan))))


def run_config(label: str, config: dict[str, Any], args: argparse.Namespace, workdir: Path) -> Result:
    opts = stack.StackOptions.on_free_ports(
        args.sims,
        model=MODEL,
        sim_args=sim_args(args),
        config=config,
        epp_args=["--log-level", "warning", "--allow-experimental-plugins"],
        ready_timeout=READY_TIMEOUT,
    )
    with stack.LocalStack(opts, workdir / label) as st:
        plan = workload(args)
        t0 = time.monotonic()
        ttfts = asyncio.run(_drive(st.url, plan, args.max_tokens))
        wall = time.monotonic() - t0
        ok = [t for t in ttfts if t is not None]
        made = loads(opts.sim_ports)
        return Result(label, len(plan), len(plan) - len(ok), wall, made, ok, decisions(opts.metrics_port))


def print_table(results: list[Result]) -> None:
    print()
    print("| config | requests | errors | adapter loads | loads/min | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.label} | {r.requests} | {r.errors} | {r.loads} | {r.loads_per_minute:.0f} | "
            f"{percentile(r.ttft_ms, 0.5):.1f} | {percentile(r.ttft_ms, 0.9):.1f} |"
        )
    for r in results:
        if r.decisions:
            print(
                f"{r.label}: lora-residency-filter decisions "
                + ", ".join(f"{k} {v}" for k, v in r.decisions.items())
            )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs", nargs="+", default=["affinity", "residency"], choices=["affinity", "residency"]
    )
    p.add_argument("--sims", type=int, default=4)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of adapter popularity")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-cpu-loras", type=int, default=8)
    p.add_argument("--lora-load-time", type=float, default=150.0, help="cold adapter load, ms")
    p.add_argument("--lora-host-load-time", type=float, default=30.0, help="load from the host cache, ms")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sim-args", default="", help="more epp sim flags")
    p.add_argument("--keep-logs", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-lora-"))
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"{args.sims} sims x {args.max_loras} GPU adapter slots (host cache {args.max_cpu_loras}), "
        f"{args.adapters} adapters, Zipf {args.zipf:g}, {args.requests} requests at {args.rate:g}/s "
        f"(Poisson, seed {args.seed}); loads {args.lora_load_time:g} ms cold, "
        f"{args.lora_host_load_time:g} ms from the host cache",
        flush=True,
    )
    results: list[Result] = []
    known = configs()

    def run() -> int:
        for label in args.configs:
            result = run_config(label, known[label], args, workdir)
            print(
                f"  {label}: {result.requests - result.errors}/{result.requests} ok in {result.wall:.1f} s",
                flush=True,
            )
            results.append(result)
        return 0

    return run_in_workdir(
        workdir,
        run,
        errors=(RuntimeError, OSError, stack.ChildExited),
        keep_logs=args.keep_logs,
        report=lambda: print_table(results),
    )


if __name__ == "__main__":
    sys.exit(main())
