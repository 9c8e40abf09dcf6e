"""HTTP/2 attacks on the EPP's ext_proc port, with a well-behaved client measured meanwhile
(``make bench-h2-attacks``).

Per server (``--servers epp,grpcio``: ``epp serve --extproc-server``) and attack, a fresh ``epp serve``
and a real Envoy in front of it (ext_proc over TCP, the port the attacker hits) route chat completions
to ``epp sim`` servers shared by all runs. A good client sends ``--rate`` requests/s through Envoy for
``--before`` s, during the attack (a client of ``bench/_h2_attack_clients.py`` on 127.0.0.1, bounded
by ``--duration`` and a frame count) and ``--after`` s after it; the EPP's RSS is sampled from /proc
and the EPP is killed above ``--rss-limit``. Prints the table of docs/benchmarks.md (peak RSS, success
rate and median latency per phase, recovery) and the issue's targets met or not per row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._h2_attack_clients import ATTACKS
from bench._workdir import run_in_workdir
from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config

MODEL = "demo"
PATH = "/v1/chat/completions"
ATTACKER = Path(__file__).with_name("_h2_attack_clients.py")
SIM_ARGS = ["--time-to-first-token", "0", "--prefill-time-per-token", "0", "--inter-token-latency", "0"]
SIM_ARGS += ["--max-tokens", "4"]
SERVER_LABEL = {"epp": "epp", "grpcio": "grpc.aio"}
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1 << 20
REQUEST_TIMEOUT = 10.0  # the good client's bound per request (Envoy's ext_proc message timeout: 5 s)
SAMPLE_EVERY = 0.05  # RSS sampling period
# The targets (docs/benchmarks.md)
RSS_TARGET_MB = 600
GOOD_SUCCESS = 0.90
LATENCY_FACTOR = 5.0
LATENCY_FLOOR = 0.100
RECOVERY_S = 10.0


# ------------------------------------------------------------------------------------- measuring


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(slots=True)
class Sample:
    start: float  # seconds after the run's start
    latency: float
    ok: bool


@dataclass
class Phase:
    requests: int
    ok: int
    p50_ms: float | None  # of the successful ones

    @property
    def success(self) -> float:
        return self.ok / self.requests if self.requests else 0.0

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> Phase:
        good = [s.latency for s in samples if s.ok]
        return cls(len(samples), len(good), statistics.median(good) * 1000 if good else None)


@dataclass
class Row:
    attack: str
    server: str
    peak_rss_mb: float
    end_rss_mb: float
    stopped: bool  # killed above --rss-limit
    died: bool  # exited by itself
    before: Phase
    during: Phase
    after: Phase
    recovery_s: float | None  # after the attack, when every later request was normal again
    serves_after: bool
    attack_seconds: float
    attacker: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, bool] = field(default_factory=dict)

    def latency_limit_ms(self) -> float:
        base = self.before.p50_ms or 0.0
        return max(LATENCY_FACTOR * base, LATENCY_FLOOR * 1000)


def recovery(samples: Sequence[Sample], attack_end: float, limit_s: float) -> float | None:
    """Seconds after ``attack_end`` from which every request started was successful within
    ``limit_s`` (None when the last one was not)."""
    after = sorted((s for s in samples if s.start >= attack_end), key=lambda s: s.start)
    if not after:
        return None
    at: float | None = 0.0
    for s in after:
        if not s.ok or s.latency > limit_s:
            at = None
        elif at is None:
            at = s.start - attack_end
    return at


# ---------------------------------------------------------------------------------- the EPP stack


class Rig:
    """The shared ``epp sim`` servers; per run an EPP and its Envoy (``start_target``)."""

    def __init__(self, workdir: Path, sims: int, epp_root: Path | None, via_socket: bool) -> None:
        self.workdir = workdir
        self.stack = stack.Stack(workdir, ready_timeout=60.0)
        self.sim_ports = stack.free_ports(sims)
        self.epp_root = epp_root
        self.via_socket = via_socket
        self.endpoints = workdir / "endpoints.yaml"

    def start_sims(self) -> None:
        children = [
            self.stack.start_sim(f"sim-{i}", port, model=MODEL, args=[*SIM_ARGS, "--max-num-seqs", "1024"])
            for i, port in enumerate(self.sim_ports)
        ]
        for child, port in zip(children, self.sim_ports, strict=True):
            self.stack.wait_sim(child, f"http://127.0.0.1:{port}")
        stack.write_endpoints(self.endpoints, self.sim_ports)

    def epp_argv(self, grpc_port: int, health_port: int, metrics_port: int, server: str) -> list[str]:
        import yaml

        extra = ["--log-level", "warning", f"--extproc-server={server}"]
        if self.via_socket:
            extra += ["--grpc-socket", stack.epp_socket(grpc_port)]
        argv = stack.serve_argv(
            grpc_port=grpc_port,
            health_port=health_port,
            metrics_port=metrics_port,
            config_text=yaml.safe_dump(stack.epp_config(self.endpoints), sort_keys=False),
            extra=extra,
        )
        if self.epp_root is not None:  # python -m epp -> that checkout's own epp
            argv = [str(self.epp_root / ".venv" / "bin" / "epp"), *argv[3:]]
        return argv

    def start_target(self, name: str, server: str) -> Target:
        grpc_port, health_port, metrics_port, port, admin_port = stack.free_ports(5)
        epp = self.stack.supervisor.start(
            f"epp-{name}", self.epp_argv(grpc_port, health_port, metrics_port, server)
        )
        target = Target(self, epp, None, grpc_port, port)
        try:
            self.stack.wait_epp(epp, health_port)
            bootstrap = envoy_config.envoy_bootstrap(
                listen_port=port,
                admin_port=admin_port,
                extproc_port=grpc_port,
                extproc_socket=stack.epp_socket(grpc_port) if self.via_socket else "",
            )
            target.envoy = self.stack.start_envoy(f"envoy-{name}", bootstrap, concurrency=1)
            self.stack.wait_envoy(target.envoy, admin_port)
            self.stack.wait(
                f"POST {PATH} through envoy-{name}",
                lambda: _post_ok(target.url),
                children=[epp, target.envoy],
            )
        except BaseException:
            target.stop()
            raise
        return target

    def stop(self) -> None:
        self.stack.stop()


@dataclass
class Target:
    rig: Rig
    epp: stack.Child
    envoy: stack.Child | None
    grpc_port: int
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{PATH}"

    def stop(self) -> None:
        for child in (self.envoy, self.epp):
            if child is not None:
                child.stop()
                with contextlib.suppress(ValueError):
                    self.rig.stack.children.remove(child)


CHAT = json.dumps(
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello from the good client"}]}
).encode()


def _post_ok(url: str) -> bool:
    import urllib.request

    req = urllib.request.Request(url, data=CHAT, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3.0) as resp:
            resp.read()
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------- a run


class _Run:
    """One attack against one target, with the good client and the RSS sampler on one event loop."""

    def __init__(self, args: argparse.Namespace, target: Target, attack: str, workdir: Path) -> None:
        self.args = args
        self.target = target
        self.attack = attack
        self.workdir = workdir
        self.samples: list[Sample] = []
        self.peak = 0
        self.stopped = False
        self.t0 = 0.0
        self.until = float("inf")  # monotonic time the good client stops sending

    async def _good_client(self, session: Any) -> None:
        """Open loop: a request every 1/rate s until ``self.until`` (moved by ``run``), whatever
        the answers do; then waits for those in flight (each bounded by REQUEST_TIMEOUT)."""
        import aiohttp

        period = 1.0 / self.args.rate
        tasks: set[asyncio.Task[None]] = set()

        async def one() -> None:
            start = time.monotonic()
            ok = False
            try:
                async with session.post(
                    self.target.url,
                    data=CHAT,
                    headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
                ) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError, OSError):
                ok = False
            self.samples.append(Sample(start - self.t0, time.monotonic() - start, ok))

        next_at = time.monotonic()
        while next_at < self.until:
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT + 1)

    async def _sampler(self, stop: asyncio.Event, attacker: list[stack.Child]) -> None:
        pid = self.target.epp.pid
        limit = self.args.rss_limit * MB
        while not stop.is_set():
            rss = rss_bytes(pid)
            self.peak = max(self.peak, rss)
            if rss > limit and not self.stopped:
                self.stopped = True
                print(f"    EPP RSS {rss / MB:.0f} MB > {self.args.rss_limit} MB: stopped", flush=True)
                self.target.epp.kill()
                for child in attacker:
                    child.stop(timeout=1.0)
            await asyncio.sleep(SAMPLE_EVERY)

    async def run(self) -> Row:
        import aiohttp

        args = self.args
        stats_file = self.workdir / f"{self.attack}-{self.target.epp.name}.json"
        argv = [
            sys.executable,
            str(ATTACKER),
            self.attack,
            "--port",
            str(self.target.grpc_port),
            "--duration",
            str(args.duration),
            "--streams",
            str(args.streams),
            "--stats",
            str(stats_file),
        ]
        attacker: list[stack.Child] = []
        stop = asyncio.Event()
        self.t0 = time.monotonic()
        sampler = asyncio.create_task(self._sampler(stop, attacker))
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        attack_start = attack_end = 0.0
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                before_end = self.t0 + args.before
                self.until = before_end + args.duration + 60  # moved at the end of the attack
                client = asyncio.create_task(self._good_client(session))
                await asyncio.sleep(max(0.0, before_end - time.monotonic()))
                attack_start = time.monotonic() - self.t0
                child = self.target.rig.stack.supervisor.start(f"attack-{self.attack}", argv)
                attacker.append(child)
                hard_stop = time.monotonic() + args.duration + 10.0  # the attacker stops itself before
                while child.running() and time.monotonic() < hard_stop and not self.stopped:
                    await asyncio.sleep(0.05)
                child.stop(timeout=2.0)
                with contextlib.suppress(ValueError):
                    self.target.rig.stack.children.remove(child)
                attack_end = time.monotonic() - self.t0
                self.until = self.t0 + attack_end + args.after
                await client
                serves = False
                if not self.stopped and self.target.epp.running():
                    serves = await asyncio.to_thread(_post_ok, self.target.url)
        finally:
            stop.set()
            await sampler
        return self._row(attack_start, attack_end, serves, stats_file)

    def _row(self, attack_start: float, attack_end: float, serves: bool, stats_file: Path) -> Row:
        samples = self.samples
        before = Phase.of([s for s in samples if s.start < attack_start])
        during = Phase.of([s for s in samples if attack_start <= s.start < attack_end])
        after = Phase.of([s for s in samples if s.start >= attack_end])
        try:
            attacker = json.loads(stats_file.read_text())
        except (OSError, ValueError):
            attacker = {}
        epp = self.target.epp
        row = Row(
            self.attack,
            self.args.server,
            self.peak / MB,
            rss_bytes(epp.pid) / MB if epp.running() else 0.0,
            self.stopped,
            not self.stopped and not epp.running(),
            before,
            during,
            after,
            None,
            serves,
            attack_end - attack_start,
            attacker,
        )
        row.recovery_s = recovery(samples, attack_end, row.latency_limit_ms() / 1000)
        return row


# ---------------------------------------------------------------------------------------- targets


def check_targets(rows: Sequence[Row], rss_limit: int) -> None:
    """Each row's targets: peak RSS <= 600 MB (or grpc.aio's on the same attack, where higher) and
    not stopped; during the attack >= 90 % successful with p50 <= 5x before (or 100 ms); after it,
    every request normal again within 10 s and the server still serving."""
    grpc_peak = {r.attack: r.peak_rss_mb for r in rows if r.server == "grpcio" and not r.stopped}
    for r in rows:
        rss_cap = RSS_TARGET_MB
        if r.server == "epp" and grpc_peak.get(r.attack, 0) > RSS_TARGET_MB:
            rss_cap = grpc_peak[r.attack]
        r.targets = {
            "rss": not r.stopped and r.peak_rss_mb <= rss_cap,
            "good": r.during.requests > 0 and r.during.success >= GOOD_SUCCESS,
            "p50": r.during.p50_ms is not None and r.during.p50_ms <= r.latency_limit_ms(),
            "recovery": r.recovery_s is not None and r.recovery_s <= RECOVERY_S,
            "serves": r.serves_after,
        }


def _rss(r: Row, limit: int) -> str:
    return f"> {limit} MB (stopped)" if r.stopped else f"{r.peak_rss_mb:.0f} MB"


def _phase(p: Phase) -> str:
    p50 = f"{p.p50_ms:.0f} ms" if p.p50_ms is not None else "-"
    return f"{p.success * 100:.0f} %, {p50}"


def _verdict(r: Row) -> str:
    failed = [k for k, ok in r.targets.items() if not ok]
    return "met" if not failed else "not met (" + ", ".join(failed) + ")"


def print_tables(rows: Sequence[Row], servers: Sequence[str], rss_limit: int) -> None:
    by = {(r.attack, r.server): r for r in rows}
    attacks = list(dict.fromkeys(r.attack for r in rows))
    head = "| attack | " + " | ".join(f"{SERVER_LABEL[s]}: peak RSS, good %, p50" for s in servers)
    print("\n" + head + " | " + " | ".join(f"{SERVER_LABEL[s]} targets" for s in servers) + " |")
    print("|---" * (1 + 2 * len(servers)) + "|")
    for attack in attacks:
        cells, verdicts = [], []
        for s in servers:
            r = by.get((attack, s))
            cells.append(f"{_rss(r, rss_limit)}, {_phase(r.during)}" if r else "-")
            verdicts.append(_verdict(r) if r else "-")
        print(f"| {ATTACKS[attack][1]} | " + " | ".join(cells) + " | " + " | ".join(verdicts) + " |")
    print(
        "\n| attack | server | before | during | after | recovered | serves after | RSS at end "
        "| attack: s, frames, streams, conns, GOAWAYs |"
    )
    print("|---" * 9 + "|")
    for r in rows:
        recovered = f"{r.recovery_s:.1f} s" if r.recovery_s is not None else "no"
        goaways = sum(r.attacker.get("goaway_codes", {}).values())
        a = r.attacker
        sent = f"{r.attack_seconds:.0f} s, {a.get('frames', 0):,}, {a.get('streams', 0):,}, "
        sent += f"{a.get('connections', 0)}, {goaways}"
        end = "killed" if r.stopped else ("exited" if r.died else f"{r.end_rss_mb:.0f} MB")
        print(
            f"| {r.attack} | {SERVER_LABEL[r.server]} | {_phase(r.before)} | {_phase(r.during)} "
            f"| {_phase(r.after)} | {recovered} | {'yes' if r.serves_after else 'no'} | {end} | {sent} |"
        )


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--servers", default="epp,grpcio", help="ext_proc servers, in order (default epp,grpcio)")
    add("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of: {', '.join(ATTACKS)}")
    add("--duration", type=float, default=15.0, help="seconds per attack (default 15; --short 3)")
    add("--before", type=float, default=5.0, help="good traffic before each attack (default 5 s; --short 2)")
    add("--after", type=float, default=10.0, help="good traffic after each attack (default 10 s; --short 4)")
    add("--short", action="store_true", help="a smoke run: 3 s attacks, 2 s before, 4 s after")
    add("--rate", type=float, default=20.0, help="good client requests per second (default 20)")
    add("--rss-limit", type=int, default=2048, help="MB of EPP RSS at which it is killed (default 2048)")
    add(
        "--streams",
        type=int,
        default=400_000,
        help="streams-held: streams to open; the attacker stops at the end of --duration with what the "
        "server took by then (default 400000)",
    )
    add("--sims", type=int, default=2, help="epp sim servers (default 2)")
    add("--epp-root", type=Path, help="run DIR/.venv/bin/epp (another checkout) instead of this tree's")
    add(
        "--envoy-via",
        choices=["tcp", "socket"],
        default="tcp",
        help="how Envoy reaches the EPP: tcp (default: the attacked port, as a gateway) or socket",
    )
    add("--json", type=Path, help="also write the rows here")
    add("--keep-logs", action="store_true", help="keep the work directory (logs) on success")
    args = parser.parse_args(argv)
    if args.short:
        args.duration, args.before, args.after = 3.0, 2.0, 4.0
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.attack_list = [a.strip() for a in args.attacks.split(",") if a.strip()]
    for s in args.server_list:
        if s not in SERVER_LABEL:
            parser.error(f"--servers: unknown server {s!r} (epp, grpcio)")
    for a in args.attack_list:
        if a not in ATTACKS:
            parser.error(f"--attacks: unknown attack {a!r}")
    if not 0 < args.duration <= 120 or args.rate <= 0 or args.before < 1 or args.after < 1:
        parser.error("--duration must be within (0, 120] s, --rate > 0, --before and --after >= 1 s")
    if args.epp_root is not None and not (args.epp_root / ".venv" / "bin" / "epp").exists():
        parser.error(f"--epp-root: {args.epp_root}/.venv/bin/epp does not exist (make install there)")
    return args


def _commit(root: Path) -> str:
    import subprocess

    out = subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%h"], capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    root = args.epp_root or Path(__file__).resolve().parent.parent
    workdir = Path(tempfile.mkdtemp(prefix="epp-h2-attacks-"))
    rows: list[Row] = []
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"EPP of {root}: {_commit(root)}; attacks {args.duration:g} s, good client {args.rate:g} req/s, "
        f"{args.before:g} s before, {args.after:g} s after; RSS limit {args.rss_limit} MB; "
        f"work dir {workdir}",
        flush=True,
    )

    def run() -> int:
        rig = Rig(workdir, args.sims, args.epp_root, args.envoy_via == "socket")
        # SIGTERM (a CI timeout) ends the run like Ctrl-C: every child is stopped.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            rig.start_sims()
            for server in args.server_list:  # one server at a time
                args.server = server
                for attack in args.attack_list:
                    target = rig.start_target(f"{server}-{attack}", server)
                    try:
                        print(f"  {SERVER_LABEL[server]:<8} {attack:<20}", end=" ", flush=True)
                        row = asyncio.run(_Run(args, target, attack, workdir).run())
                    finally:
                        target.stop()
                    rows.append(row)
                    print(
                        f"peak {_rss(row, args.rss_limit)}; good before {_phase(row.before)}, during "
                        f"{_phase(row.during)}, after {_phase(row.after)}; serves after: "
                        f"{'yes' if row.serves_after else 'no'}",
                        flush=True,
                    )
        finally:
            rig.stop()
        return 0

    def report() -> None:
        check_targets(rows, args.rss_limit)
        print_tables(rows, args.server_list, args.rss_limit)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
            print(f"rows written to {args.json}")

    return run_in_workdir(
        workdir,
        run,
        errors=(RuntimeError, TimeoutError, OSError, stack.ChildExited),
        keep_logs=args.keep_logs,
        report=report,
    )


if __name__ == "__main__":
    sys.exit(main())
