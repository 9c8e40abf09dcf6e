"""The EPP against many endpoints (``make bench-scale``): a farm of fake vLLM engines in one process
(``bench/_farm.py``), ``epp serve`` with file discovery and the default configuration, a front Envoy.

Per endpoint count: the EPP's idle CPU (scraping only), the scrape rate the farm saw against the
rate asked (endpoints / scrape interval), the p99 interval between two scrapes of one endpoint (the
age bound of the metrics a decision reads: a decision sees metrics at most one interval plus one
scrape old), then a fixed-rate chat load through Envoy while scraping goes on: the EPP's CPU per
request above idle, the p50/p99 latency, and the EPP's RSS. Pushed load is measured only when this
build registers ``zmq-metrics-data-source`` (otherwise the column says so).

Run: ``.venv/bin/python bench/scale.py [--endpoints 10,100,1000,5000] [--idle-seconds S]
[--load-seconds S] [--rate R]``; ``--quick`` = 10,100,1000 with short phases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._workdir import run_in_workdir
from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from epp.framework import registry

JSON = {"content-type": "application/json"}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
FARM = Path(__file__).with_name("_farm.py")
PATH = "/v1/chat/completions"
SCRAPE_INTERVAL = 0.05  # the metrics data source's default
BODY = json.dumps(
    {
        "model": "demo",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant for the scale benchmark. " * 8},
            {"role": "user", "content": "How many endpoints can one EPP hold?"},
        ],
        "max_tokens": 1,
    }
).encode()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port_range(count: int, start: int = 20000) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1."""
    base = start
    while base + count < 60000:
        held = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                held.append(s)
            return base
        except OSError:
            base = held[-1].getsockname()[1] + 2 if held else base + 1
        finally:
            for s in held:
                s.close()
    raise SystemExit(f"no {count} consecutive free ports")


def farm_stats(port: int, reset: bool = False) -> dict[str, float]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/{'reset' if reset else 'stats'}", method="POST" if reset else "GET"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


async def load(url: str, rate: float, seconds: float, connections: int = 16) -> tuple[list[float], int]:
    """Open-loop chat requests at ``rate``/s for ``seconds``; latencies (s) of the successes, errors."""
    latencies: list[float] = []
    errors = 0
    sem = asyncio.Semaphore(connections * 4)
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            nonlocal errors
            async with sem:
                t0 = time.perf_counter()
                try:
                    async with session.post(
                        url, data=BODY, headers={"content-type": "application/json"}
                    ) as r:
                        await r.read()
                        if r.status == 200:
                            latencies.append(time.perf_counter() - t0)
                        else:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1

        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies, errors


def q(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


def measure(n: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    base = free_port_range(n)
    control, port, admin, grpc_port, health, metrics_port = stack.free_ports(6)
    run = stack.Stack(workdir / f"n{n}", ready_timeout=120.0)
    run.workdir.mkdir(parents=True, exist_ok=True)
    try:
        farm = run.supervisor.start(
            "farm",
            [
                sys.executable,
                str(FARM),
                "--base-port",
                str(base),
                "--count",
                str(n),
                "--control-port",
                str(control),
            ],
        )
        run.wait("farm", lambda: stack.port_in_use(control), children=[farm])
        endpoints = run.workdir / "endpoints.yaml"
        stack.write_endpoints(endpoints, list(range(base, base + n)))
        epp = run.start_epp(
            "epp",
            grpc_port=grpc_port,
            health_port=health,
            metrics_port=metrics_port,
            config=stack.epp_config(endpoints),
        )
        bootstrap = envoy_config.envoy_bootstrap(listen_port=port, admin_port=admin, extproc_port=grpc_port)
        run.start_envoy("envoy", bootstrap)
        run.wait("EPP readiness", lambda: stack.grpc_serving(health))
        url = f"http://127.0.0.1:{port}{PATH}"

        def routed() -> bool:
            try:
                r = urllib.request.urlopen(urllib.request.Request(url, data=BODY, method="POST"), timeout=5)
                return bool(r.status == 200)
            except OSError:
                return False

        run.wait("a request through Envoy", routed)
        time.sleep(args.settle)  # every endpoint discovered and scraped a few times
        pid = epp.pid
        farm_stats(control, reset=True)
        c0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(args.idle_seconds)
        c1, t1 = cpu_seconds(pid), time.monotonic()
        idle = farm_stats(control)
        idle_cores = (c1 - c0) / (t1 - t0)
        asked = n / SCRAPE_INTERVAL
        achieved = idle["scrapes"] / idle["seconds"]

        c2, t2 = cpu_seconds(pid), time.monotonic()
        latencies, errors = asyncio.run(load(url, args.rate, args.load_seconds))
        c3, t3 = cpu_seconds(pid), time.monotonic()
        done = len(latencies)
        # all of the EPP's CPU while loaded, per request (scraping included), and above idle (the
        # latter is noise, even negative, when the load slows scraping down)
        load_cpu_us = (c3 - c2) / done * 1e6 if done else float("nan")
        request_cpu_us = ((c3 - c2) - idle_cores * (t3 - t2)) / done * 1e6 if done else float("nan")
        return {
            "endpoints": n,
            "idle_cores": idle_cores,
            "asked": asked,
            "achieved": achieved,
            "interval_p50_ms": idle["interval_p50"] * 1e3,
            "interval_p99_ms": idle["interval_p99"] * 1e3,
            "request_cpu_us": request_cpu_us,
            "load_cpu_us": load_cpu_us,
            "p50_ms": q(latencies, 0.5) * 1e3,
            "p99_ms": q(latencies, 0.99) * 1e3,
            "errors": errors,
            "requests": done,
            "rss_mb": rss_mb(pid),
        }
    finally:
        run.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--endpoints", default="10,100,1000,5000")
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--load-seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=100.0, help="chat requests per second through Envoy")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between ready and measuring")
    ap.add_argument("--quick", action="store_true", help="10,100,1000 endpoints, 4 s phases")
    args = ap.parse_args()
    if args.quick:
        args.endpoints, args.idle_seconds, args.load_seconds, args.settle = "10,100,1000", 4.0, 4.0, 3.0
    push = registry.lookup("zmq-metrics-data-source") is not None
    print(
        f"{'endpoints':>9} {'idle cores':>10} {'scrapes/s asked':>15} {'achieved':>9} "
        f"{'interval p50/p99 ms':>19} {'CPU µs/req (all/above idle)':>27} {'p50/p99 ms':>13} "
        f"{'errors':>6} {'RSS MB':>7}  push"
    )

    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-scale-"))
    failed = 0

    def body() -> int:
        nonlocal failed
        for n in (int(x) for x in args.endpoints.split(",")):
            try:
                r = measure(n, args, workdir)
            except (RuntimeError, OSError, TimeoutError) as exc:  # a count that does not fit
                print(f"{n:>9} failed: {exc}", flush=True)
                failed += 1
                continue
            print(
                f"{n:>9} {r['idle_cores']:>10.3f} {r['asked']:>15.0f} {r['achieved']:>9.0f} "
                f"{r['interval_p50_ms']:>9.0f} / {r['interval_p99_ms']:<7.0f} "
                f"{r['load_cpu_us']:>17.0f} / {r['request_cpu_us']:<7.0f} "
                f"{r['p50_ms']:>6.1f}/{r['p99_ms']:<6.1f} {r['errors']:>6} {r['rss_mb']:>7.0f}  "
                + ("(not measured here)" if push else "skipped: no zmq-metrics-data-source in this build"),
                flush=True,
            )
        return 1 if failed else 0

    sys.exit(run_in_workdir(workdir, body, errors=(), keep_logs=False))


if __name__ == "__main__":
    main()
