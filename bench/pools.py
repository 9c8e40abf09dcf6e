"""One EPP serving 1, 10 and 100 pools of 4 endpoints each (``make bench-pools``).

The endpoints are light fakes in one process (an aiohttp server on 4 x N ports answering ``/metrics``
in vLLM's format and chat completions at once), scraped for real by the EPP. One Envoy has a virtual
host per pool (``epp envoy-config --pool``). Steady load round robin over every pool; per run:
EPP CPU per request (the whole process, less its idle rate; and the serving thread alone, where
every request's work runs while the scrapes run on the data layer's thread), its RSS, its idle CPU
(no load, scrapes going on), and the cross-pool routes (a request answered by an endpoint of another
pool: must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epp.dev import stack
from epp.dev.envoy.bootstrap import envoy_bootstrap
from epp.dev.stack.files import epp_config, write_atomic
from epp.dev.stack.probes import grpc_serving

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PER_POOL = 4
METRICS = (
    b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="demo"} 0\n'
    b'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="demo"} 0\n'
    b'# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="demo"} 0.1\n'
)
ANSWER = (
    b'{"id":"x","object":"chat.completion","model":"demo","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
)


def fake_main(ports: list[int], ready_file: str = "") -> None:
    """The fake endpoints: every port answers /metrics and any POST (its port in x-inference-port);
    ``ready_file`` is written once every port listens."""
    from aiohttp import web

    async def serve() -> None:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=METRICS, content_type="text/plain")

        async def answer(request: web.Request) -> web.Response:
            await request.read()
            port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
            return web.Response(
                body=ANSWER, content_type="application/json", headers={"x-inference-port": str(port)}
            )

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", metrics)
        app.router.add_post("/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port, backlog=512).start()
        if ready_file:
            Path(ready_file).write_text("listening\n")
        await asyncio.Event().wait()

    asyncio.run(serve())


def _listening(ports: list[int]) -> bool:
    import socket

    for port in ports:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
    return True


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def thread_cpu_seconds(pid: int) -> float:
    """CPU of the process's main thread alone: the event loop that serves every request (the data
    layer's scrapes run on a thread of their own)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def load(
    url: str, pools: dict[str, set[int]], requests: int, connections: int, rate: float = 0.0
) -> tuple[int, int, int]:
    """``requests`` chat requests round robin over the pools, at ``rate`` per second (0: as fast as
    ``connections`` allow); (ok, failed, cross-pool)."""
    import aiohttp

    names = sorted(pools)
    body = b'{"model":"demo","messages":[{"role":"user","content":"hello there"}]}'
    counts = [0, 0, 0]
    next_i = 0
    start = time.monotonic()

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_i
        while next_i < requests:
            i = next_i
            pool = names[i % len(names)]
            next_i += 1
            if rate > 0:  # a steady arrival rate: request i leaves at start + i / rate
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            headers = {"Host": pool, "content-type": "application/json"}
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    counts[1] += 1
                    if counts[1] == 1:
                        print(f"first failure: {resp.status} {(await resp.read())[:300]!r}", flush=True)
                    continue
                counts[0] += 1
                if int(resp.headers.get("x-inference-port", "0")) not in pools[pool]:
                    counts[2] += 1

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(connections)))
    return counts[0], counts[1], counts[2]


def run(
    n_pools: int, requests: int, connections: int, workdir: Path, scrape: str, rate: float = 0.0
) -> dict[str, Any]:
    unique: set[int] = set()
    while len(unique) < n_pools * PER_POOL:  # free_port() may return a port twice
        unique.add(stack.free_port())
    ports = sorted(unique)
    pools = {f"pool-{i}": set(ports[i * PER_POOL : (i + 1) * PER_POOL]) for i in range(n_pools)}
    endpoints = workdir / f"endpoints-{n_pools}.yaml"
    document = {
        "pools": [
            {
                "name": name,
                "endpoints": [{"name": f"e-{p}", "address": "127.0.0.1", "port": p} for p in sorted(ps)],
            }
            for name, ps in pools.items()
        ]
    }
    write_atomic(endpoints, yaml.safe_dump(document))
    grpc_port, health_port, metrics_port = stack.free_port(), stack.free_port(), stack.free_port()
    listen, admin = stack.free_port(), stack.free_port()
    with stack.Stack(workdir / f"run-{n_pools}", ready_timeout=120) as s:
        ready = workdir / f"fake-{n_pools}.ready"
        ready.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--fake", ",".join(map(str, ports)), "--fake-ready", str(ready)]
        fake = s.supervisor.start("fake", command)
        # every port bound (a port taken meanwhile by another process ends the fake: run again); one
        # connection per port once the fake says so (polling 400 ports kept a loaded machine's fake busy)
        s.wait("the fake endpoints", ready.exists, children=[fake])
        s.wait("the fake endpoints", lambda: _listening(ports), children=[fake])
        epp = s.start_epp(
            "epp",
            grpc_port=grpc_port,
            health_port=health_port,
            metrics_port=metrics_port,
            config=epp_config(endpoints),
            extra=["--log-level", "warning", "--refresh-metrics-interval", scrape],
        )
        envoy = s.start_envoy(
            "envoy",
            envoy_bootstrap(listen_port=listen, admin_port=admin, extproc_port=grpc_port, pools=list(pools)),
        )
        s.wait("EPP ready", lambda: grpc_serving(health_port), children=[epp])
        s.wait_envoy(envoy, admin)
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        asyncio.run(load(url, pools, min(requests, 200), connections))  # warm-up: every pool once
        time.sleep(2.0)
        assert epp.proc is not None
        pid = epp.proc.pid
        idle0, idle_main0 = cpu_seconds(pid), thread_cpu_seconds(pid)
        time.sleep(5.0)
        idle = (cpu_seconds(pid) - idle0) / 5.0
        idle_main = (thread_cpu_seconds(pid) - idle_main0) / 5.0
        c0, m0, t0 = cpu_seconds(pid), thread_cpu_seconds(pid), time.monotonic()
        ok, failed, cross = asyncio.run(load(url, pools, requests, connections, rate))
        cpu, wall = cpu_seconds(pid) - c0, time.monotonic() - t0
        main = thread_cpu_seconds(pid) - m0
        return {
            "pools": n_pools,
            "endpoints": len(ports),
            "requests_ok": ok,
            "failed": failed,
            "cross_pool": cross,
            "cpu_us_per_request": 1e6 * cpu / max(ok, 1),
            # less what the EPP spends without load (scrapes) over the same time
            "net_cpu_us_per_request": 1e6 * max(cpu - idle * wall, 0.0) / max(ok, 1),
            # the serving thread alone (every request's work; no scrape), less its own idle rate
            "serving_us_per_request": 1e6 * max(main - idle_main * wall, 0.0) / max(ok, 1),
            "other_threads_cpu_pct": 100 * (cpu - main) / wall,
            "rps": ok / wall,
            "rss_mb": rss_mb(pid),
            "idle_cpu_pct": 100 * idle,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fake", default="", help=argparse.SUPPRESS)
    parser.add_argument("--fake-ready", default="", help=argparse.SUPPRESS)
    parser.add_argument("--pools", default="1,10,100", help="pool counts to run (default 1,10,100)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--rate",
        type=float,
        default=100.0,
        help="requests per second, the same for every pool count (default 100; 0: as fast as the "
        "connections go, which compares runs at different rates: CPU per request falls as the rate "
        "rises, the event loop batching more per wake-up)",
    )
    parser.add_argument(
        "--scrape-interval",
        default="50ms",
        help="the EPP's --refresh-metrics-interval (default 50ms, the reference's; at 400 endpoints "
        "scraping alone then costs about half a core)",
    )
    args = parser.parse_args()
    if args.fake:
        fake_main([int(p) for p in args.fake.split(",")], args.fake_ready)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-pools-") as tmp:
        for n in (int(x) for x in args.pools.split(",")):
            for attempt in range(3):
                try:
                    row = run(n, args.requests, args.connections, Path(tmp), args.scrape_interval, args.rate)
                    break
                except stack.ChildExited as e:  # a port was taken meanwhile: again, on other ports
                    if attempt == 2:
                        raise
                    print(f"{e}: running again", flush=True)
            rows.append(row)
            print(row, flush=True)
    base = rows[0]
    print(
        "\n| pools | endpoints | CPU µs/req | net µs/req | net vs first | serving thread µs/req | "
        "serving vs first | other threads CPU % under load | RSS MB | RSS/extra pool MB |",
        end="",
    )
    print(" idle CPU % | rps | failed | cross-pool |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = r["pools"] - base["pools"]
        per_pool = (r["rss_mb"] - base["rss_mb"]) / extra if extra else 0.0
        ratio = r["net_cpu_us_per_request"] / max(base["net_cpu_us_per_request"], 1e-9)
        serving = r["serving_us_per_request"] / max(base["serving_us_per_request"], 1e-9)
        print(
            f"| {r['pools']} | {r['endpoints']} | {r['cpu_us_per_request']:.0f} | "
            f"{r['net_cpu_us_per_request']:.0f} | {ratio:.2f}x | {r['serving_us_per_request']:.0f} | "
            f"{serving:.2f}x | {r['other_threads_cpu_pct']:.1f} | {r['rss_mb']:.0f} | {per_pool:.2f} | "
            f"{r['idle_cpu_pct']:.1f} | {r['rps']:.0f} | {r['failed']} | {r['cross_pool']} |"
        )
    return 0 if all(r["cross_pool"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
