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
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._workdir import run_in_workdir
from epp.config.defaults import default_document
from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from epp.dev.stack.redis_server import RedisServer
from epp.plugins.scraping.zmq_metrics_data_source import LOAD_PORT_LABEL

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


def cpu_seconds(pid: int, tid: int = 0) -> float:
    """CPU seconds of process ``pid``, or of its thread ``tid`` (the main thread: ``tid == pid``)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def age_buckets(metrics_port: int) -> dict[float, float]:
    """``llm_d_epp_decision_metrics_age_seconds`` cumulative bucket counts (all profiles)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llm_d_epp_decision_metrics_age_seconds_bucket":
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], p: float) -> float:
    """The ``p`` quantile of the observations between two bucket readings (linear within a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan")
    rank = p * total
    lower, below = 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return lower
            return lower + (b - lower) * ((rank - below) / (c - below) if c > below else 1.0)
        lower, below = b, c
    return lower


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


def scheduling_config(endpoints: Path, push_port: int = 0, shared: str = "") -> dict[str, Any]:
    """The default scorers, scraping every 50 ms; with ``push_port`` also pushed load
    (``zmq-metrics-data-source``, each endpoint's publisher port on its label); with ``shared`` (a
    redis address) the replicas share the scrape over a ``redis-syncer``."""
    if not push_port and not shared:
        return stack.epp_config(endpoints)
    cfg = default_document()  # what ``epp serve`` runs without a config, plus the sources below
    plugins: list[dict[str, Any]] = cfg["plugins"]
    data_layer: dict[str, Any] = cfg["dataLayer"]
    sources: list[dict[str, Any]] = data_layer["sources"]
    if push_port:
        plugins += [
            {"type": "zmq-metrics-data-source", "parameters": {"port": push_port, "fallbackAfter": "3s"}},
            {"type": "zmq-state-extractor"},
        ]
        sources.append(
            {"pluginRef": "zmq-metrics-data-source", "extractors": [{"pluginRef": "zmq-state-extractor"}]}
        )
    if shared:
        plugins.append(
            {"name": "shared", "type": "redis-syncer", "parameters": {"address": shared, "stateTTL": "2s"}}
        )
        data_layer["crossReplica"] = {"syncerPluginRef": "shared", "syncInterval": "100ms"}
        data_layer["discovery"] = {"peers": {"pluginRef": "shared"}}
    return stack.epp_config(endpoints, cfg)


def measure(n: int, args: argparse.Namespace, workdir: Path, mode: str = "scrape") -> dict[str, Any]:
    """``mode``: ``scrape`` (one EPP scraping every 50 ms), ``push`` (the farm publishes LoadStat,
    the EPP subscribes; scraping only as the fallback), ``replicas`` (3 EPPs sharing the scrape
    over a real redis-server; idle only)."""
    base = free_port_range(n)
    push_base = free_port_range(n, base + n + 10) if mode == "push" else 0
    control, port, admin = stack.free_ports(3)
    run = stack.Stack(workdir / f"n{n}-{mode}", ready_timeout=180.0)
    run.workdir.mkdir(parents=True, exist_ok=True)
    redis = None
    try:
        farm_argv = [sys.executable, str(FARM), "--base-port", str(base), "--count", str(n)]
        farm_argv += ["--control-port", str(control)]
        if push_base:
            farm_argv += ["--push-base-port", str(push_base), "--push-interval", str(args.push_interval)]
        farm = run.supervisor.start("farm", farm_argv)
        run.wait("farm", lambda: stack.port_in_use(control), children=[farm])
        endpoints = run.workdir / "endpoints.yaml"
        names = [f"sim-{i}" for i in range(n)]
        labels = (
            {name: {LOAD_PORT_LABEL: str(push_base + i)} for i, name in enumerate(names)}
            if push_base
            else None
        )
        stack.write_endpoints(endpoints, list(range(base, base + n)), names=names, labels=labels)
        shared = ""
        if mode == "replicas":
            redis = RedisServer(run.workdir).start()
            shared = redis.address
        config = scheduling_config(endpoints, push_port=push_base or 0, shared=shared)
        epps = []
        for r in range(3 if mode == "replicas" else 1):
            grpc_port, health, metrics_port = stack.free_ports(3)
            child = run.start_epp(
                f"epp{r}", grpc_port=grpc_port, health_port=health, metrics_port=metrics_port, config=config
            )
            epps.append((child, grpc_port, health, metrics_port))
        for _, _, health, _ in epps:
            run.wait("EPP readiness", lambda health=health: stack.grpc_serving(health))
        _, grpc_port, health, metrics_port = epps[0]
        if mode != "replicas":
            bootstrap = envoy_config.envoy_bootstrap(
                listen_port=port, admin_port=admin, extproc_port=grpc_port
            )
            run.start_envoy("envoy", bootstrap)
        url = f"http://127.0.0.1:{port}{PATH}"

        def routed() -> bool:
            try:
                r = urllib.request.urlopen(urllib.request.Request(url, data=BODY, method="POST"), timeout=5)
                return bool(r.status == 200)
            except OSError:
                return False

        if mode != "replicas":
            run.wait("a request through Envoy", routed)
        time.sleep(args.settle)  # every endpoint discovered and scraped (or pushed) a few times
        pids = [child.pid for child, *_ in epps]
        pid = pids[0]
        farm_stats(control, reset=True)
        c0, m0, t0 = sum(cpu_seconds(p) for p in pids), cpu_seconds(pid, pid), time.monotonic()
        time.sleep(args.idle_seconds)
        c1, m1, t1 = sum(cpu_seconds(p) for p in pids), cpu_seconds(pid, pid), time.monotonic()
        idle = farm_stats(control)
        idle_cores = (c1 - c0) / (t1 - t0) / len(pids)
        main_idle = (m1 - m0) / (t1 - t0)
        asked = n / SCRAPE_INTERVAL
        achieved = idle["scrapes"] / idle["seconds"]
        result: dict[str, Any] = {
            "endpoints": n,
            "mode": mode,
            "idle_cores": idle_cores,
            "outside_cores": idle_cores - main_idle,
            "asked": asked,
            "achieved": achieved,
            "per_engine": achieved / n,
            "pushes": idle["pushes"] / idle["seconds"],
            "interval_p50_ms": idle["interval_p50"] * 1e3,
            "interval_p99_ms": idle["interval_p99"] * 1e3,
            "rss_mb": sum(rss_mb(p) for p in pids) / len(pids),
        }
        if mode == "replicas":
            return result
        ages0 = age_buckets(metrics_port)
        c2, m2, t2 = cpu_seconds(pid), cpu_seconds(pid, pid), time.monotonic()
        latencies, errors = asyncio.run(load(url, args.rate, args.load_seconds))
        c3, m3, t3 = cpu_seconds(pid), cpu_seconds(pid, pid), time.monotonic()
        ages1 = age_buckets(metrics_port)
        done = len(latencies)
        # all of the EPP's CPU while loaded per request (scraping included), and the main thread's
        # above its idle rate: the request path (the event loop serving ext_proc)
        result.update(
            load_cpu_us=(c3 - c2) / done * 1e6 if done else float("nan"),
            request_cpu_us=((m3 - m2) - main_idle * (t3 - t2)) / done * 1e6 if done else float("nan"),
            p50_ms=q(latencies, 0.5) * 1e3,
            p99_ms=q(latencies, 0.99) * 1e3,
            errors=errors,
            requests=done,
            age_p50_ms=bucket_quantile(ages0, ages1, 0.5) * 1e3,
            age_p99_ms=bucket_quantile(ages0, ages1, 0.99) * 1e3,
            rss_mb=rss_mb(pid),
        )
        return result
    finally:
        run.stop()
        if redis is not None:
            redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--endpoints", default="10,100,1000,5000")
    ap.add_argument("--modes", default="scrape,push,replicas", help="which of: scrape, push, replicas")
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--load-seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=100.0, help="chat requests per second through Envoy")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between ready and measuring")
    ap.add_argument(
        "--push-interval", type=float, default=1.0, help="each farm endpoint's LoadStat period (s)"
    )
    ap.add_argument("--quick", action="store_true", help="10,100,1000 endpoints, 4 s phases")
    args = ap.parse_args()
    if args.quick:
        args.endpoints, args.idle_seconds, args.load_seconds, args.settle = "10,100,1000", 4.0, 4.0, 3.0
    modes = args.modes.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-scale-"))
    failed = 0

    def body() -> int:
        nonlocal failed
        for mode in modes:
            print(f"--- {mode}", flush=True)
            for n in (int(x) for x in args.endpoints.split(",")):
                try:
                    r = measure(n, args, workdir, mode)
                except (RuntimeError, OSError, TimeoutError) as exc:  # a count that does not fit
                    print(f"{n:>6} failed: {exc}", flush=True)
                    failed += 1
                    continue
                print(
                    json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}),
                    flush=True,
                )
        return 1 if failed else 0

    sys.exit(run_in_workdir(workdir, body, errors=(), keep_logs=False))


if __name__ == "__main__":
    main()
