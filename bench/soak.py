"""Soak: the real stack under mixed good and hostile traffic, then a kill -9 of the EPP (``make bench-soak``).

Phase 1 measures memory, streams, ``/metrics`` size and outcomes; phase 2 kills the EPP behind a
fail-open Envoy in each body mode (set-up in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _soak_traffic as traffic
from bench._workdir import run_in_workdir
from epp.dev import stack

MODEL = "demo"
SIM_ARGS = [
    "--time-to-first-token",
    "2",
    "--prefill-time-per-token",
    "0",
    "--inter-token-latency",
    "1",
    "--max-tokens",
    "8",
    "--max-num-seqs",
    "256",
]
DEFAULT_MAX_BODY = 10 << 20
SCRAPE_TIMEOUT = 30.0
BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
EPP_MARK_HEADER = "x-went-into-resp-headers"


# ------------------------------------------------------------------------- the failing simulator


def flaky_sim_main(argv: list[str]) -> int:
    """``soak.py --flaky-sim <epp sim flags>``: an ``epp sim`` whose ``GET /metrics`` always fails."""
    from aiohttp import web

    from epp.dev.sim import cli as sim_cli
    from epp.dev.sim.server import SimServer

    parser = argparse.ArgumentParser(prog="soak.py --flaky-sim")
    sim_cli.add_arguments(parser)
    config = sim_cli.config_from_args(parser.parse_args(argv))
    calls = Counter[str]()

    @web.middleware
    async def failing_metrics(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/metrics":
            return await handler(request)
        calls["n"] += 1
        turn = calls["n"] % 3
        if turn == 0:
            return web.Response(status=500, text="metrics are broken\n")
        if turn == 1:
            return web.Response(text='vllm:num_requests_waiting{model_name="demo" 3\n\x00garbage{{{\n')
        await asyncio.sleep(30)
        return web.Response(status=503, text="too late\n")

    async def serve() -> None:
        server = SimServer(config)
        server.app.middlewares.append(failing_metrics)
        await server.start()
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


# ------------------------------------------------------------------------------ measuring


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def established_connections(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (the server's side), from /proc."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})?\s+(?P<value>\S+)")


def parse_page(text: str) -> tuple[dict[str, str], dict[str, float], int]:
    """(type per metric family, sum per sample name, number of series) of a Prometheus text page."""
    types: dict[str, str] = {}
    sums: dict[str, float] = {}
    series = 0
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        series += 1
        try:
            sums[m["name"]] = sums.get(m["name"], 0.0) + float(m["value"])
        except ValueError:
            pass
    return types, sums, series


def stream_gauges(types: dict[str, str]) -> list[str]:
    """EPP gauges that count open streams, found by name (none today; a fix may add one)."""
    return sorted(n for n, t in types.items() if t == "gauge" and "stream" in n and "bucket" not in n)


def _get(url: str, timeout: float = 10.0) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode("utf-8", "replace"))


def envoy_active_extproc(admin_port: int) -> int | None:
    try:
        text = _get(f"http://127.0.0.1:{admin_port}/stats?filter=^cluster\\.ext_proc\\.upstream_rq_active$")
    except OSError:
        return None
    m = re.search(r"upstream_rq_active: (\d+)", text)
    return int(m.group(1)) if m else None


@dataclass
class Snapshot:
    label: str
    rss_mib: float
    streams: str
    envoy_streams: int | None
    grpc_connections: int
    metrics_bytes: int
    series: int
    scrape: str
    running: float | None
    log_bytes: int


def snapshot(label: str, st: stack.LocalStack) -> Snapshot:
    assert st.epp is not None
    o = st.opts
    t0 = time.monotonic()
    try:
        page = _get(f"http://127.0.0.1:{o.metrics_port}/metrics", timeout=SCRAPE_TIMEOUT)
        scrape = f"{time.monotonic() - t0:.2f} s"
    except OSError as e:
        page, scrape = "", f"failed after {time.monotonic() - t0:.1f} s ({type(e).__name__})"
    types, sums, series = parse_page(page)
    gauges = stream_gauges(types)
    streams = (
        " + ".join(f"{sums.get(g, 0):.0f} ({g})" for g in gauges) if gauges else "no EPP gauge (see below)"
    )
    try:
        rss = rss_kib(st.epp.pid) / 1024
    except OSError:
        rss = float("nan")
    return Snapshot(
        label=label,
        rss_mib=rss,
        streams=streams,
        envoy_streams=envoy_active_extproc(o.admin_port),
        grpc_connections=established_connections(o.grpc_port),
        metrics_bytes=len(page.encode()),
        series=series,
        scrape=scrape,
        running=sums.get("inference_objective_running_requests") if page else None,
        log_bytes=st.epp.log_path.stat().st_size if st.epp.log_path.exists() else 0,
    )


def print_snapshots(snaps: Sequence[Snapshot]) -> None:
    rows: list[tuple[str, Callable[[Snapshot], str]]] = [
        ("EPP RSS (MiB)", lambda s: f"{s.rss_mib:.1f}"),
        ("open ext_proc streams, EPP gauge", lambda s: s.streams),
        (
            "  Envoy ext_proc upstream_rq_active",
            lambda s: "-" if s.envoy_streams is None else str(s.envoy_streams),
        ),
        ("  TCP conns on the gRPC port (/proc)", lambda s: str(s.grpc_connections)),
        ("/metrics page (bytes)", lambda s: str(s.metrics_bytes)),
        ("/metrics series", lambda s: str(s.series)),
        ("/metrics scrape time", lambda s: s.scrape),
        ("running-requests gauge (sum)", lambda s: "-" if s.running is None else f"{s.running:g}"),
        ("EPP log (bytes)", lambda s: str(s.log_bytes)),
    ]
    width = max(26, *(len(s.label) + 2 for s in snaps), *(len(s.streams) + 2 for s in snaps))
    print(f"{'':<38}" + "".join(f"{s.label:>{width}}" for s in snaps))
    for name, cell in rows:
        print(f"{name:<38}" + "".join(f"{cell(s):>{width}}" for s in snaps))
    sys.stdout.flush()


def print_tally(title: str, tally: traffic.Tally, kinds: Sequence[str] | None = None) -> None:
    print(title)
    for kind in kinds if kinds is not None else sorted(tally.counts):
        counts = tally.counts.get(kind)
        if not counts:
            continue
        total = sum(counts.values())
        cells = ", ".join(f"{status}: {n}" for status, n in counts.most_common())
        print(f"  {kind:<40} {total:>7}  {cells}")
    sys.stdout.flush()


# ------------------------------------------------------------------------------ the stack


def serve_help() -> str:
    out = subprocess.run(
        stack.python_argv("serve", "--help"), capture_output=True, text=True, timeout=60, check=False
    )
    return out.stdout


def stack_options(args: argparse.Namespace, *, body_mode: str, fail_open: bool) -> stack.StackOptions:
    return stack.StackOptions.on_free_ports(
        args.sims,
        model=MODEL,
        sim_args=list(SIM_ARGS),
        body_mode=body_mode,
        fail_open=fail_open,
        epp_args=list(args.epp_args),
    )


def add_flaky_sim(st: stack.LocalStack) -> int:
    """Start the simulator whose /metrics fails and add it to the EPP's endpoints file."""
    port = stack.free_port()
    name = f"sim-{len(st.sims)}"
    argv = [sys.executable, str(Path(__file__).resolve()), "--flaky-sim", "--port", str(port)]
    argv += ["--name", name, "--model", MODEL, *SIM_ARGS]
    child = st.supervisor.start(f"{name}-flaky-metrics", argv)
    st.wait_sim(child, f"http://127.0.0.1:{port}", what="the simulator with failing /metrics")
    stack.write_endpoints(st.endpoints_file, [*st.opts.sim_ports, port])
    return port


class ChildDied(RuntimeError):
    """A process of the stack whose exit is fatal (the EPP, Envoy, the failing-metrics simulator,
    or a simulator past its restart budget) exited during the soak."""


# ------------------------------------------------------------------------------ phase 1


@dataclass
class SoakPlan:
    duration: float
    rate: float
    stalled: int
    partial: int
    partial_mib: int
    max_body: int
    progress: float
    hostile_scale: float


async def soak(
    st: stack.LocalStack, plan: SoakPlan, seed: int
) -> tuple[list[Snapshot], traffic.Tally, traffic.Tally, int]:
    import aiohttp

    good_tally, bad_tally = traffic.Tally(), traffic.Tally()
    snaps = [await asyncio.to_thread(snapshot, "start", st)]
    print_snapshots(snaps)
    t0 = time.monotonic()
    deadline = t0 + plan.duration
    build = deadline - plan.duration * 2 / 3  # held streams are opened over the first third
    good_conn = aiohttp.TCPConnector(limit=256)
    bad_conn = aiohttp.TCPConnector(limit=128)
    async with (
        aiohttp.ClientSession(connector=good_conn) as good_session,
        aiohttp.ClientSession(connector=bad_conn) as bad_session,
    ):
        good = traffic.GoodClient(good_session, st.url, good_tally, model=MODEL, seed=seed)
        http = traffic.HostileHttp(bad_session, st.url, bad_tally, model=MODEL, max_body=plan.max_body)
        grpc_clients = traffic.HostileGrpc(st.opts.grpc_port, bad_tally, model=MODEL)
        h = plan.hostile_scale
        skipped = Counter[str]()

        def run(kind: str, rate: float, fn: Callable[[int], Any], limit: int, until: float = deadline) -> Any:
            return traffic.paced(
                rate,
                until,
                fn,
                limit=limit,
                rng=random.Random(f"{kind}-{seed}"),
                on_skip=lambda: skipped.update([kind]),
            )

        build_seconds = max(build - t0, 1.0)
        release = asyncio.Event()  # set after the "end" snapshot: the held streams are let go
        jobs = [
            run("good", plan.rate, good.one, 512),
            run("distinct models", 20 * h, http.many_models, 64),
            run("malformed JSON", 2 * h, http.malformed_json, 16),
            run("deep JSON", 1 * h, http.deep_json, 8),
            run("oversized", 0.2 * h, http.oversized, 2),
            run("duplicate end_of_stream", 2 * h, grpc_clients.duplicate_end_of_stream, 16),
            run("undecodable", 1 * h, grpc_clients.undecodable_message, 8),
            run("malformed frames", 1 * h, grpc_clients.malformed_frames, 8),
            _held(plan.stalled, build_seconds, deadline, release, grpc_clients.stall_after_headers),
            _held(
                plan.partial,
                build_seconds,
                deadline,
                release,
                lambda i: grpc_clients.hold_partial_body(i, mib=plan.partial_mib),
            ),
        ]
        tasks = [asyncio.create_task(j) for j in jobs]
        died: str | None = None
        next_progress = t0 + plan.progress
        while time.monotonic() < deadline and died is None:
            await asyncio.sleep(0.5)
            fatal = st.poll()  # restarts a simulator that exited; the EPP or Envoy exiting is fatal
            if fatal is not None:
                died = f"{fatal.name} exited ({fatal.returncode()}) after {time.monotonic() - t0:.0f} s"
                break
            if time.monotonic() >= next_progress:
                next_progress += plan.progress
                s = await asyncio.to_thread(snapshot, f"t={time.monotonic() - t0:.0f}s", st)
                good_ok = (
                    good_tally.counts.get("plain", Counter())["200"]
                    + good_tally.counts.get("stream", Counter())["200"]
                )
                good_n = good_tally.total("plain") + good_tally.total("stream")
                print(
                    f"  t={time.monotonic() - t0:5.0f}s  good {good_ok}/{good_n} ok, "
                    f"{good.unique_prompts} unique prompts; EPP RSS {s.rss_mib:.1f} MiB, /metrics "
                    f"{s.metrics_bytes} bytes / {s.series} series (scrape {s.scrape}); held streams open "
                    "(client view) "
                    f"{grpc_clients.open_count()}; Envoy ext_proc streams {s.envoy_streams}, "
                    f"TCP conns {s.grpc_connections}",
                    flush=True,
                )
        if died is None:
            await asyncio.sleep(1.0)  # the last requests finish; the held streams stay
            held_open = grpc_clients.open_count()
            snaps.append(await asyncio.to_thread(snapshot, "end (held open)", st))
        else:
            held_open = grpc_clients.open_count()
            for task in tasks:
                task.cancel()
        release.set()
        await asyncio.wait(tasks, timeout=60)
        await grpc_clients.close()
        if skipped:  # starts that would have exceeded a kind's concurrency cap
            bad_tally.counts["(any client) starts skipped at its cap"] = skipped
        unique = good.unique_prompts
    if died is not None:
        raise ChildDied(died)
    await asyncio.sleep(3)
    snaps.append(await asyncio.to_thread(snapshot, "after clients left", st))
    print(f"  held streams still open at the end (client view): {held_open}", flush=True)
    return snaps, good_tally, bad_tally, unique


async def _held(
    count: int, over: float, deadline: float, release: asyncio.Event, open_one: Callable[[int], Any]
) -> None:
    """Open ``count`` long-lived streams evenly over ``over`` seconds (none after ``deadline``);
    keep them until ``release`` is set (at most 120 s after the deadline)."""
    tasks = []
    for i in range(count):
        if time.monotonic() >= deadline:
            break
        tasks.append(asyncio.create_task(open_one(i)))
        await asyncio.sleep(over / max(count, 1))
    try:
        await asyncio.wait_for(release.wait(), max(deadline - time.monotonic(), 0) + 120)
    except TimeoutError:
        pass
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def phase1(args: argparse.Namespace, plan: SoakPlan, workdir: Path) -> int:
    opts = stack_options(args, body_mode=args.body_mode, fail_open=False)
    print(
        f"\n=== phase 1: soak, {plan.duration:.0f} s, {args.body_mode}, fail-closed, {args.sims} sims "
        f"+ 1 with failing /metrics ===",
        flush=True,
    )
    with stack.LocalStack(opts, workdir / "phase1") as st:
        add_flaky_sim(st)
        time.sleep(2.0)  # the EPP reads the endpoints file again
        print(
            f"good {plan.rate:g}/s; hostile x{plan.hostile_scale:g}: distinct models 20/s, "
            "malformed JSON 2/s, "
            f"deep JSON 1/s, over-limit bodies ({plan.max_body + 65536} bytes) 0.2/s, duplicate "
            f"end_of_stream 2/s, undecodable messages 1/s, malformed frames 1/s; held: {plan.stalled} "
            f"stalled after headers, {plan.partial} x {plan.partial_mib} MiB partial bodies",
            flush=True,
        )
        try:
            snaps, good, bad, unique = _run(soak(st, plan, args.seed))
        except ChildDied as e:
            print(f"\nFATAL during the soak: {e}")
            for child in st.supervisor.children:
                if not child.running():
                    print(f"--- last lines of {child.log_path} ---\n{child.tail(30)}")
            return 1
        print()
        print_snapshots(snaps)
        gauge_note = (
            "open ext_proc streams: no EPP gauge with 'stream' in its name, so Envoy's "
            "cluster.ext_proc.upstream_rq_active (the streams Envoy holds) and the established TCP "
            "connections on the EPP's gRPC port from /proc/net/tcp (one per direct hostile channel, a "
            "few from Envoy) stand in"
            if snaps[0].streams.startswith("no EPP gauge")
            else "open ext_proc streams: from the EPP's own gauge"
        )
        print(gauge_note)
        print(f"unique prompts sent: {unique}")
        print_tally("well-behaved clients by status:", good, ["plain", "stream"])
        print_tally("hostile clients by status:", bad)
    return 0


# ------------------------------------------------------------------------------ phase 2


async def kill_run(
    st: stack.LocalStack, args: argparse.Namespace, seed: int
) -> tuple[traffic.Tally, dict[str, float]]:
    import aiohttp

    assert st.epp is not None
    tally = traffic.Tally(keep_timeline=True)
    marks: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
        good = _MarkedClient(session, st.url, tally, model=MODEL, seed=seed)
        t0 = good.t0
        total = args.before + args.down + args.after + 60  # the traffic loop's own hard bound
        load = asyncio.create_task(
            traffic.paced(args.rate, t0 + total, good.one, limit=512, rng=random.Random(f"kill-{seed}"))
        )
        await asyncio.sleep(args.before)
        marks["kill"] = time.monotonic() - t0
        await asyncio.to_thread(st.epp.kill)
        await asyncio.sleep(args.down)
        marks["restart"] = time.monotonic() - t0
        st.epp.respawn()
        await asyncio.to_thread(st.wait_epp, st.epp, st.opts.health_port, what="the restarted EPP")
        marks["ready"] = time.monotonic() - t0
        await asyncio.sleep(args.after)
        marks["end"] = time.monotonic() - t0
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
        # Requests still in flight when the load was stopped are not counted (they were cancelled).
    return tally, marks


class _MarkedClient(traffic.GoodClient):
    """A good client that also says whether the response passed the EPP."""

    def status(self, resp: Any, payload: bytes, stream: bool) -> str:
        mark = " via EPP" if resp.headers.get(EPP_MARK_HEADER) else " bypassed"
        return super().status(resp, payload, stream) + mark


def phase2(args: argparse.Namespace, workdir: Path) -> int:
    print(
        f"\n=== phase 2: kill -9 of the EPP under load ({args.rate:g} req/s), fail-open bootstrap; "
        f"{args.before:g} s before, restarted after {args.down:g} s, {args.after:g} s after it is ready ===",
        flush=True,
    )
    for mode in args.kill_modes:
        opts = stack_options(args, body_mode=mode, fail_open=True)
        with stack.LocalStack(opts, workdir / f"phase2-{mode.lower()}") as st:
            tally, marks = _run(kill_run(st, args, args.seed))
        windows = [
            ("before the kill", 0.0, marks["kill"]),
            ("kill -> restarted EPP ready", marks["kill"], marks["ready"]),
            ("after the restart", marks["ready"], float("inf")),
        ]
        print(
            f"{mode}: killed at {marks['kill']:.1f} s, started again at {marks['restart']:.1f} s, ready at "
            f"{marks['ready']:.1f} s (outage {marks['ready'] - marks['kill']:.1f} s); requests by start time:"
        )
        for name, lo, hi in windows:
            counts = Counter(f"{kind} {status}" for t, kind, status in tally.timeline if lo <= t < hi)
            total = sum(counts.values())
            errors = sum(n for s, n in counts.items() if not s.split(" ", 1)[1].startswith("200 "))
            cells = ", ".join(f"{s}: {n}" for s, n in counts.most_common())
            print(f"  {name:<30} {total:>6} requests, {errors:>4} errors  ({cells})")
        sys.stdout.flush()
    return 0


# ------------------------------------------------------------------------------ main


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--duration", type=float, default=None, help="phase 1 length in seconds (default 180; --short: 20)")
    add("--short", action="store_true", help="smoke run: 20 s soak, fewer held streams, short kill windows")
    add(
        "--sims",
        type=int,
        default=3,
        help="well-behaved simulators (default 3; one more has failing /metrics)",
    )
    add("--rate", type=float, default=40.0, help="well-behaved requests/s (default 40)")
    add("--body-mode", choices=BODY_MODES, default="FULL_DUPLEX_STREAMED", help="phase 1 body mode")
    add("--stalled", type=int, default=None, help="streams that stall after headers (default 200; short 40)")
    add("--partial", type=int, default=None, help="streams holding a partial body (default 16; short 4)")
    add("--partial-mib", type=int, default=4, help="MiB of partial body per such stream (default 4)")
    add("--hostile-scale", type=float, default=1.0, help="factor on every hostile rate (default 1)")
    add("--progress", type=float, default=None, help="seconds between progress lines (default 30; short 5)")
    add("--before", type=float, default=None, help="phase 2: seconds of load before the kill (10; short 4)")
    add("--down", type=float, default=None, help="phase 2: seconds the EPP stays dead (5; short 2)")
    add("--after", type=float, default=None, help="phase 2: seconds after it is ready again (10; short 4)")
    add("--kill-modes", nargs="*", choices=BODY_MODES, default=list(BODY_MODES), help="phase 2 body modes")
    add("--skip-soak", action="store_true", help="only phase 2")
    add("--epp-arg", dest="epp_args", action="append", default=[], help="extra flag for epp serve")
    add("--seed", type=int, default=1)
    add("--keep-logs", action="store_true", help="keep the work directory (logs) on success")
    args = parser.parse_args(argv)
    short = args.short

    def pick(value: float | None, normal: float, smoke: float) -> float:
        return value if value is not None else (smoke if short else normal)

    args.duration = pick(args.duration, 180, 20)
    args.stalled = int(pick(args.stalled, 200, 40))
    args.partial = int(pick(args.partial, 16, 4))
    args.progress = pick(args.progress, 30, 5)
    args.before, args.down, args.after = (
        pick(args.before, 10, 4),
        pick(args.down, 5, 2),
        pick(args.after, 10, 4),
    )
    if args.duration <= 0 or args.sims < 1 or args.rate <= 0:
        parser.error("--duration, --sims and --rate must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--flaky-sim"]:
        return flaky_sim_main(argv[1:])
    args = parse_args(argv)
    help_text = serve_help()
    max_body = DEFAULT_MAX_BODY
    flag = re.search(r"--max-request-body-bytes", help_text)
    if flag and not any(a.startswith("--max-request-body-bytes") for a in args.epp_args):
        args.epp_args.append(f"--max-request-body-bytes={max_body}")
    for a in args.epp_args:
        if a.startswith("--max-request-body-bytes="):
            max_body = int(a.split("=", 1)[1])
    plan = SoakPlan(
        duration=args.duration,
        rate=args.rate,
        stalled=args.stalled,
        partial=args.partial,
        partial_mib=args.partial_mib,
        max_body=max_body,
        progress=args.progress,
        hostile_scale=args.hostile_scale,
    )
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-soak-"))
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"work dir {workdir}; nproc {len(os.sched_getaffinity(0))}; epp serve {shlex.join(args.epp_args)}")

    def run() -> int:
        status = 0
        if not args.skip_soak:
            status = phase1(args, plan, workdir)
        if args.kill_modes:
            status = phase2(args, workdir) or status
        return status

    return run_in_workdir(
        workdir, run, errors=(RuntimeError, TimeoutError, OSError), keep_logs=args.keep_logs
    )


if __name__ == "__main__":
    sys.exit(main())
