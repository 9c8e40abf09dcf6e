"""EPP CPU per request and requests/s through a real Envoy (``make bench-cpu``).

For each body mode (BUFFERED and FULL_DUPLEX_STREAMED by default) the script starts the local stack
of ``epp run`` on free ports (3 simulators answering at once: no prefill, no inter-token delay, one
output token; the EPP with its default scheduling config; Envoy), warms it up, then R times sends N
non-streaming ~1 KB chat requests from a separate load-generator process with C concurrent
connections and reads the EPP's CPU time from ``/proc/<pid>/stat`` (utime + stime) before and after:

    EPP CPU µs per request = delta(utime + stime) / N

The load generator is ``wrk`` with a Lua POST script when ``wrk`` is on PATH (one thread), otherwise
this script itself in ``--loadgen`` mode (aiohttp on uvloop). The medians over the R runs are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epp import stack

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SIM_ARGS = [
    "--time-to-first-token",
    "0",
    "--inter-token-latency",
    "0",
    "--max-tokens",
    "1",
    "--max-num-seqs",
    "1024",
]
PATH = "/v1/chat/completions"


# ------------------------------------------------------------------------------------- measuring


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """CPU seconds per second the process spends with no requests (background work)."""
    if seconds <= 0:
        return 0.0
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - t0)


def chat_body(size: int = 1024) -> bytes:
    """A non-streaming chat request of about ``size`` bytes."""
    base = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    filler = size - len(json.dumps(base))
    base["messages"][0]["content"] = ("The quick brown fox jumps over the lazy dog. " * (size // 40 + 1))[
        : max(filler, 0)
    ]
    return json.dumps(base).encode()


@dataclass
class LoadResult:
    completed: int
    errors: int
    seconds: float

    @property
    def rps(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0


# ------------------------------------------------------------------------------- load generators


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = io.open("%(body)s", "rb"):read("*a")
local limit = %(requests)d
local done = 0
function response(status, headers, body)
  done = done + 1
  if done == limit then
    io.open("%(marker)s", "w"):close()
    wrk.thread:stop()
  end
end
"""


def run_wrk(url: str, body_file: Path, requests: int, connections: int, workdir: Path) -> LoadResult:
    """Run wrk (one thread) until it has ``requests`` responses.

    wrk is duration-based: the Lua script stops its thread after ``requests`` responses and drops a
    marker file; this function then sends SIGINT, on which wrk prints its summary and exits.
    """
    marker = workdir / "wrk.done"
    marker.unlink(missing_ok=True)
    script = workdir / "post.lua"
    script.write_text(WRK_SCRIPT % {"body": body_file, "requests": requests, "marker": marker})
    argv = ["wrk", "-t1", f"-c{connections}", "-d3600s", "--timeout", "30s", "-s", str(script), url]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return parse_wrk(out)


def parse_wrk(out: str) -> LoadResult:
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if done is None:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[done.group(3)]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    if socket_errors:
        errors += sum(int(g) for g in socket_errors.groups())
    total = int(done.group(1))
    return LoadResult(total - (int(bad.group(1)) if bad else 0), errors, float(done.group(2)) * scale)


def run_python_loadgen(url: str, body_file: Path, requests: int, connections: int) -> LoadResult:
    argv = [sys.executable, __file__, "--loadgen", url, str(body_file), str(requests), str(connections)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    return LoadResult(data["completed"], data["errors"], data["seconds"])


async def _loadgen(url: str, body: bytes, requests: int, connections: int) -> dict[str, Any]:
    import aiohttp

    remaining = requests
    completed = errors = 0
    headers = {"content-type": "application/json"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, completed, errors
        while remaining > 0:
            remaining -= 1
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status == 200:
                        completed += 1
                    else:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1

    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(connections)))
        seconds = time.perf_counter() - start
    return {"completed": completed, "errors": errors, "seconds": seconds}


def loadgen_main(argv: list[str]) -> int:
    url, body_file, requests, connections = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(_loadgen(url, body_file.read_bytes(), requests, connections))
    print(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------------ bench


@dataclass
class RunResult:
    mode: str
    rps: float
    epp_us: float
    epp_net_us: float
    envoy_us: float
    completed: int
    errors: int


def _stack_options(mode: str, sims: int) -> stack.StackOptions:
    base = _consecutive_free_ports(sims)
    return stack.StackOptions(
        sims=sims,
        sim_base_port=base,
        sim_args=list(SIM_ARGS),
        port=stack.free_port(),
        admin_port=stack.free_port(),
        grpc_port=stack.free_port(),
        health_port=stack.free_port(),
        metrics_port=stack.free_port(),
        body_mode=mode,
    )


def _consecutive_free_ports(count: int) -> int:
    for _ in range(50):
        base = stack.free_port()
        if base + count < 65536 and not any(stack.port_in_use(base + i) for i in range(count)):
            return base
    raise RuntimeError("no block of free ports")


def bench_mode(mode: str, args: argparse.Namespace, workdir: Path, body_file: Path) -> list[RunResult]:
    opts = _stack_options(mode, args.sims)
    url = f"http://127.0.0.1:{opts.port}{PATH}"
    results: list[RunResult] = []
    with stack.LocalStack(opts, workdir / mode) as local:
        assert local.epp is not None and local.envoy is not None
        load(url, body_file, args.warmup, args.concurrency, args.tool, workdir)
        idle = idle_cpu_rate(local.epp.pid, args.idle_seconds)
        print(f"  {mode:<21} idle EPP CPU (metrics scraping etc.): {idle * 100:.1f} % of a core", flush=True)
        for run in range(1, args.runs + 1):
            epp0, envoy0, t0 = cpu_seconds(local.epp.pid), cpu_seconds(local.envoy.pid), time.monotonic()
            res = load(url, body_file, args.requests, args.concurrency, args.tool, workdir)
            wall = time.monotonic() - t0
            epp_cpu = cpu_seconds(local.epp.pid) - epp0
            envoy_cpu = cpu_seconds(local.envoy.pid) - envoy0
            n = max(res.completed + res.errors, 1)
            result = RunResult(
                mode,
                res.rps,
                epp_cpu / n * 1e6,
                max(epp_cpu - idle * wall, 0.0) / n * 1e6,
                envoy_cpu / n * 1e6,
                res.completed,
                res.errors,
            )
            results.append(result)
            print(
                f"  {mode:<21} run {run}: {result.rps:8.0f} req/s   EPP {result.epp_us:6.0f} µs/req "
                f"({result.epp_net_us:.0f} above idle)   Envoy {result.envoy_us:5.0f} µs/req   "
                f"({res.completed} ok, {res.errors} errors, {res.seconds:.1f} s)",
                flush=True,
            )
    return results


def load(url: str, body_file: Path, requests: int, connections: int, tool: str, workdir: Path) -> LoadResult:
    if tool == "wrk":
        return run_wrk(url, body_file, requests, connections, workdir)
    return run_python_loadgen(url, body_file, requests, connections)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--loadgen"]:
        return loadgen_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--requests", type=int, default=20000, help="requests per run (default 20000)")
    parser.add_argument(
        "-c", "--concurrency", type=int, default=32, help="concurrent connections (default 32)"
    )
    parser.add_argument("-r", "--runs", type=int, default=3, help="runs per mode; the median is reported (3)")
    parser.add_argument("--warmup", type=int, default=1000, help="requests before measuring (default 1000)")
    parser.add_argument(
        "--idle-seconds", type=float, default=3.0, help="idle EPP CPU measured before the runs (default 3 s)"
    )
    parser.add_argument("--sims", type=int, default=3, help="simulated model servers (default 3)")
    parser.add_argument("--body-bytes", type=int, default=1024, help="request body size (default 1024)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["BUFFERED", "FULL_DUPLEX_STREAMED"],
        choices=["BUFFERED", "FULL_DUPLEX_STREAMED"],
    )
    parser.add_argument(
        "--tool",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="load generator (default: wrk if on PATH)",
    )
    args = parser.parse_args(argv)
    if args.tool == "auto":
        args.tool = "wrk" if shutil.which("wrk") else "python"
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    body_file = workdir / "body.json"
    body_file.write_bytes(chat_body(args.body_bytes))
    print(
        f"EPP CPU per request: {args.requests} requests x {args.runs} runs, {args.concurrency} connections, "
        f"{len(body_file.read_bytes())}-byte chat bodies, load generator: {args.tool}, logs: {workdir}",
        flush=True,
    )
    summary: list[tuple[str, float, float, float, float]] = []
    try:
        for mode in args.modes:
            results = bench_mode(mode, args, workdir, body_file)
            summary.append(
                (
                    mode,
                    statistics.median(r.rps for r in results),
                    statistics.median(r.epp_us for r in results),
                    statistics.median(r.epp_net_us for r in results),
                    statistics.median(r.envoy_us for r in results),
                )
            )
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        print(f"error: {e}\nlogs in {workdir}", file=sys.stderr)
        return 1
    print(f"\nmedian of {args.runs} runs")
    print(f"{'body mode':<22}{'req/s':>10}{'EPP µs/req':>14}{'above idle':>12}{'Envoy µs/req':>15}")
    for mode, rps, epp_us, net_us, envoy_us in summary:
        print(f"{mode:<22}{rps:>10.0f}{epp_us:>14.0f}{net_us:>12.0f}{envoy_us:>15.0f}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
