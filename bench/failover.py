"""A dead engine under load (``make bench-failover``): kill -9 of one of three simulators while about
50 streaming requests per second flow through Envoy and the EPP, before and after fail-over.

Runs, each on a fresh stack (3 ``epp sim``, ``epp serve`` over an endpoints file, Envoy from the
generator's lean bootstrap):

- ``before``: today's defaults switched off: no fail-over in the bootstrap, and an
  ``endpoint-health-filter`` that excludes nothing (a refused scrape does not take the endpoint out).
- ``after``: the shipped defaults (fail-over, the health filter with passive health).

Open-loop Poisson arrivals at ``--rate`` for ``--duration`` s; ``sim-0`` is killed at ``--kill-at`` s.
Per run: requests sent, completed, and failed by kind: ``cut`` (the response had started: the
generation was running on the killed engine), ``5xx`` (an error status: the request never reached a
live engine), ``client`` (no response at all). Only ``cut`` requests are acceptable losses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from epp.dev import stack
from epp.dev.envoy.bootstrap import envoy_bootstrap

MODEL = "demo"
SIM_ARGS = ["--time-to-first-token", "20", "--inter-token-latency", "20", "--max-tokens", "16"]
# "before": the health filter present (it is added to every configuration) but excluding nothing.
_INERT_HEALTH = {
    "type": "endpoint-health-filter",
    "parameters": {
        "excludeDown": False,
        "excludeNeverScraped": False,
        "connectFailures": 0,
        "serverErrors": 0,
    },
}


@dataclass
class Outcome:
    start: float
    status: int = 0
    kind: str = "ok"  # ok, cut, 5xx, client
    port: str = ""
    detail: str = ""


async def _one(session: aiohttp.ClientSession, url: str, t0: float, rng: random.Random) -> Outcome:
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": f"failover bench {rng.random()}"}],
    }
    out = Outcome(start=time.monotonic() - t0)
    try:
        async with session.post(url, json=body) as resp:
            out.status = resp.status
            out.port = resp.headers.get("x-inference-port", "")
            if resp.status != 200:
                out.kind = "5xx" if resp.status >= 500 else "4xx"
                out.detail = (await resp.text())[:160]
                return out
            seen_done = False
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    seen_done = True
            if not seen_done:
                out.kind, out.detail = "cut", "stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError) as e:
        out.kind = "cut" if out.status == 200 else "client"
        out.detail = f"{type(e).__name__}: {e}"[:160]
    return out


async def _drive(
    url: str, rate: float, duration: float, kill_at: float, kill: Any, seed: int
) -> list[Outcome]:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()
        tasks: list[asyncio.Task[Outcome]] = []
        killed = False
        at = 0.0
        while at < duration:
            at += rng.expovariate(rate)
            delay = t0 + at - time.monotonic()
            if not killed and at >= kill_at:
                await asyncio.sleep(max(0.0, t0 + kill_at - time.monotonic()))
                kill()
                killed = True
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, t0, rng)))
        return list(await asyncio.gather(*tasks))


def _run(name: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    with stack.Stack(workdir / name, log_dir=workdir / name) as st:
        ports = stack.free_ports(3)
        sims = [st.start_sim(f"sim-{i}", p, model=MODEL, args=SIM_ARGS) for i, p in enumerate(ports)]
        for child, port in zip(sims, ports, strict=True):
            st.wait_sim(child, f"http://127.0.0.1:{port}")
        endpoints = workdir / name / "endpoints.yaml"
        stack.write_endpoints(endpoints, ports, names=[f"sim-{i}" for i in range(3)])
        base = None if name == "after" else {"plugins": [_INERT_HEALTH]}
        config = stack.epp_config(endpoints, base)
        listen, admin, grpc_port, health, metrics = stack.free_ports(5)
        epp = st.start_epp(
            "epp",
            grpc_port=grpc_port,
            health_port=health,
            metrics_port=metrics,
            config=config,
            extra=["--log-level", "warning"],
        )
        st.wait_epp(epp, health)
        bootstrap = envoy_bootstrap(
            listen_port=listen, admin_port=admin, extproc_port=grpc_port, failover=name == "after"
        )
        envoy = st.start_envoy("envoy", bootstrap, concurrency=1)
        st.wait_envoy(envoy, admin)
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        st.wait("a request through Envoy", stack.http_ok(f"http://127.0.0.1:{listen}/v1/models"))
        outcomes = asyncio.run(_drive(url, args.rate, args.duration, args.kill_at, sims[0].kill, args.seed))
    kinds = Counter(o.kind for o in outcomes)
    after_kill = [o for o in outcomes if o.start >= args.kill_at]
    return {
        "run": name,
        "sent": len(outcomes),
        "ok": kinds["ok"],
        "failed": len(outcomes) - kinds["ok"],
        "cut": kinds["cut"],
        "5xx": kinds["5xx"],
        "client": kinds["client"],
        "failed_sent_after_kill": sum(o.kind != "ok" for o in after_kill),
        "served_by_killed_after_kill": sum(o.port == str(ports[0]) for o in after_kill),
        "examples": sorted({o.detail for o in outcomes if o.kind != "ok"})[:3],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals")
    parser.add_argument("--kill-at", type=float, default=2.0, help="seconds into the run sim-0 is killed")
    parser.add_argument("--runs", nargs="+", default=["before", "after"], choices=["before", "after"])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="epp-bench-failover-") as tmp:
        results = [_run(name, Path(tmp), args) for name in args.runs]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"kill -9 of 1 of 3 simulators at {args.kill_at}s, "
        f"{args.rate:g} streaming req/s for {args.duration:g}s"
    )
    cols = ("run", "sent", "ok", "failed", "cut", "5xx", "client", "failed_sent_after_kill")
    print(" ".join(f"{c:>22}" if i else f"{c:<8}" for i, c in enumerate(cols)))
    for r in results:
        print(" ".join(f"{r[c]!s:>22}" if i else f"{r[c]!s:<8}" for i, c in enumerate(cols)))
    for r in results:
        for example in r["examples"]:
            print(f"  {r['run']}: {example}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
