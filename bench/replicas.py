"""Active-active EPP replicas under load (``make bench-replicas``): what the shared state costs and
what faults do to clients.

Every run is ``epp run --replicas 3``'s stack (:class:`epp.dev.stack.LocalStack`: prefix-caching
``epp sim`` servers, three ``epp serve`` behind one Envoy whose ext_proc cluster is health-checked,
one private ``redis-server``) under the same seeded open-loop load (``bench/_loadgen.py``'s groups:
streaming chat requests sharing a few system prompts). Runs:

- ``syncer-off`` / ``syncer-on``: the replicas each learning alone, then sharing through Redis. EPP
  CPU (the three processes, ``/proc``) idle and per request, Redis CPU and bytes per request (``INFO``
  ``used_cpu_*``, ``total_net_*_bytes``), the sync lag and round trip p99 (the replicas'
  ``llm_d_epp_cross_replica_sync_lag_seconds`` / ``_sync_duration_seconds`` histograms), hit rate.
- ``kill-replica-open`` / ``kill-replica-closed``: ``kill -9`` of one replica at ``--kill-at`` with
  the fail-open and the fail-closed bootstrap; the requests that failed, split into those in flight
  at the kill and those sent after it.
- ``redis-restart``: Redis killed at ``--kill-at`` and started again (empty) ``--redis-down`` s later;
  failed requests, the time until every replica is connected and sees its peers again, and the time
  until the hit rate (per request: cached / prompt tokens, from the usage chunks) is back.

Figures and the command in docs/benchmarks.md; never asserted by tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _loadgen
from bench.routing import CHARS_PER_TOKEN, default_sim_args, percentile, sim_help
from epp.dev import stack

MODEL = "demo"
RUNS = ("syncer-off", "syncer-on", "kill-replica-open", "kill-replica-closed", "redis-restart")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_TICKS = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------------- measuring


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _get(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"] == name:
            out.append((m["labels"] or "", float(m["value"])))
    return out


def _buckets(texts: Sequence[str], name: str) -> dict[float, float]:
    """Cumulative ``name_bucket`` counts by upper bound, summed over the pages."""
    out: dict[float, float] = {}
    for text in texts:
        for labels, value in _samples(text, f"{name}_bucket"):
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                bound = float(le[1])
                out[bound] = out.get(bound, 0.0) + value
    return out


def _bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of the observations between two scrapes."""
    delta = sorted((b, after.get(b, 0.0) - before.get(b, 0.0)) for b in after)
    if not delta or delta[-1][1] <= 0:
        return None
    target = q * delta[-1][1]
    return next(b for b, n in delta if n >= target)


def _gauge_sum(texts: Sequence[str], name: str) -> float:
    return sum(v for t in texts for _, v in _samples(t, name))


def _redis_info(port: int) -> dict[str, float]:
    import redis

    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
        info = client.info()
        client.close()
    except redis.RedisError:
        return {}
    keys = ("used_cpu_sys", "used_cpu_user", "total_net_input_bytes", "total_net_output_bytes")
    return {k: float(info.get(k, 0)) for k in keys}


# ------------------------------------------------------------------------------------ the runs


@dataclass
class Result:
    run: str
    records: list[dict[str, Any]]
    fault_at: float | None = None
    notes: list[str] = field(default_factory=list)
    epp_cpu_idle: float | None = None  # CPU seconds per second, the three replicas, before the load
    epp_cpu: float | None = None  # CPU seconds during the load, the three replicas
    redis: dict[str, float] = field(default_factory=dict)  # INFO deltas during the load
    redis_idle: dict[str, float] = field(default_factory=dict)  # INFO deltas per second, before the load
    lag_p99: float | None = None
    sync_p99: float | None = None
    wall: float = 0.0  # seconds of the load
    streams: list[int] = field(default_factory=list)  # ext_proc streams per replica (Envoy's rq_total)
    reconnected_after: float | None = None  # redis-restart: s from the restart to every replica synced
    hit_back_after: float | None = None  # redis-restart: s from the restart to the hit rate back

    @property
    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.records if not r["error"]]

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["error"]]

    def hit_rate(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        recs = [r for r in self.ok if since <= r["start"] < until]
        prompt = sum(r["prompt_tokens"] for r in recs)
        return sum(r["cached_tokens"] for r in recs) / prompt if prompt else None


def _stack(workdir: Path, args: argparse.Namespace, sim_args: list[str], **options: Any) -> stack.LocalStack:
    opts = stack.StackOptions.on_free_ports(
        args.sims,
        replicas=args.replicas,
        model=MODEL,
        sim_args=sim_args,
        epp_args=["--log-level", "warning"],
        **options,
    )
    workdir.mkdir(parents=True, exist_ok=True)
    return stack.LocalStack(opts, workdir)


def _plan(args: argparse.Namespace) -> list[_loadgen.Planned]:
    return _loadgen.plan(
        requests=int(args.rate * args.duration),
        groups=args.groups,
        rate=args.rate,
        prompt_chars=args.prompt_tokens * CHARS_PER_TOKEN,
        max_tokens=args.max_tokens,
        model=MODEL,
        seed=args.seed,
    )


async def _drive(
    url: str, items: list[_loadgen.Planned], events: Sequence[tuple[float, Callable[[], None]]]
) -> dict[str, Any]:
    """The planned load, with ``events`` (offset, action) run on this thread at their offsets (the
    supervisor's children die with the thread that started them)."""
    t0 = time.perf_counter()

    async def fire() -> None:
        for at, action in sorted(events, key=lambda e: e[0]):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            action()

    load = asyncio.create_task(_loadgen.run([url], items, timeout=60.0, connections=512))
    await fire()
    return await load


def _streams(st: stack.LocalStack) -> list[int]:
    """ext_proc streams Envoy sent each replica (its per-host ``rq_total``), in replica order."""
    text = _get(f"http://127.0.0.1:{st.opts.admin_port}/clusters")
    by_socket = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "ext_proc" and parts[2] == "rq_total":
            by_socket[parts[1]] = int(parts[3])
    return [by_socket.get(e.socket, 0) for e in st.opts.epps()]


def _metrics_pages(st: stack.LocalStack) -> list[str]:
    return [_get(f"http://127.0.0.1:{e.metrics}/metrics") for e in st.opts.epps()]


def run_cost(name: str, workdir: Path, args: argparse.Namespace, sim_args: list[str]) -> Result:
    """Syncer on or off: CPU idle and under load, Redis INFO deltas, lag and round trip p99."""
    on = name == "syncer-on"
    with _stack(workdir / name, args, sim_args, share_state=on) as st:
        pids = [c.pid for c in st.epps]
        time.sleep(1.0)  # settle after start-up
        c0 = sum(map(_cpu_seconds, pids))
        redis_idle0 = _redis_info(st.redis_port) if on else {}
        time.sleep(args.idle)
        idle = (sum(map(_cpu_seconds, pids)) - c0) / args.idle
        redis_idle1 = _redis_info(st.redis_port) if on else {}
        pages0 = _metrics_pages(st)
        redis0 = _redis_info(st.redis_port) if on else {}
        c1 = sum(map(_cpu_seconds, pids))
        data = asyncio.run(_drive(st.url, _plan(args), []))
        cpu = sum(map(_cpu_seconds, pids)) - c1
        pages1 = _metrics_pages(st)
        redis1 = _redis_info(st.redis_port) if on else {}
        streams = _streams(st)
    result = Result(name, data["requests"], epp_cpu_idle=idle, epp_cpu=cpu, streams=streams)
    result.wall = float(data["wall_seconds"])
    result.redis = {k: redis1[k] - redis0.get(k, 0.0) for k in redis1}
    result.redis_idle = {k: (redis_idle1[k] - redis_idle0.get(k, 0.0)) / args.idle for k in redis_idle1}
    lag = "llm_d_epp_cross_replica_sync_lag_seconds"
    duration = "llm_d_epp_cross_replica_sync_duration_seconds"
    result.lag_p99 = _bucket_quantile(_buckets(pages0, lag), _buckets(pages1, lag), 0.99)
    result.sync_p99 = _bucket_quantile(_buckets(pages0, duration), _buckets(pages1, duration), 0.99)
    return result


def run_kill_replica(name: str, workdir: Path, args: argparse.Namespace, sim_args: list[str]) -> Result:
    """kill -9 of replica 1 at ``--kill-at`` (not restarted: nothing polls the supervisor)."""
    with _stack(workdir / name, args, sim_args, fail_open=name.endswith("open")) as st:
        victim = st.epps[1]
        data = asyncio.run(_drive(st.url, _plan(args), [(args.kill_at, victim.kill)]))
        streams = _streams(st)
        dead = victim.returncode()
    result = Result(name, data["requests"], fault_at=args.kill_at, streams=streams)
    result.notes.append(f"replica epp-1 exit status {dead} (killed at {args.kill_at:g} s)")
    return result


def run_redis_restart(name: str, workdir: Path, args: argparse.Namespace, sim_args: list[str]) -> Result:
    """Redis killed at ``--kill-at``, started again (empty, same port) ``--redis-down`` s later."""
    with _stack(workdir / name, args, sim_args) as st:
        redis = st.redis
        assert redis is not None
        restarted: list[float] = []
        synced: list[float] = []
        t0 = time.monotonic()

        def kill() -> None:
            redis.kill()

        def restart() -> None:
            redis.respawn()
            restarted.append(time.monotonic() - t0)

        async def watch() -> None:
            """Until every replica is connected and sees its peers after the restart."""
            want = args.replicas - 1
            while not synced:
                await asyncio.sleep(0.1)
                if not restarted:
                    continue
                pages = await asyncio.to_thread(_metrics_pages, st)
                connected = _gauge_sum(pages, "llm_d_epp_cross_replica_connected")
                peers = [v for p in pages for _, v in _samples(p, "llm_d_epp_cross_replica_peers")]
                if connected == args.replicas and peers and all(v == want for v in peers):
                    synced.append(time.monotonic() - t0)

        async def both() -> dict[str, Any]:
            watcher = asyncio.create_task(watch())
            events = [(args.kill_at, kill), (args.kill_at + args.redis_down, restart)]
            data = await _drive(st.url, _plan(args), events)
            try:
                await asyncio.wait_for(watcher, 10)
            except TimeoutError:
                pass
            return data

        data = asyncio.run(both())
        streams = _streams(st)
    result = Result(name, data["requests"], fault_at=args.kill_at, streams=streams)
    if restarted and synced:
        result.reconnected_after = synced[0] - restarted[0]
    result.hit_back_after = _hit_back(result, args.kill_at, args.kill_at + args.redis_down)
    return result


def _hit_back(result: Result, fault: float, restart: float, window: float = 2.0) -> float | None:
    """Seconds after ``restart`` until the hit rate of a ``window``-s window of requests is back to
    0.95x the hit rate of the ``window`` s before the fault (0: it never dropped)."""
    before = result.hit_rate(fault - window, fault)
    if before is None:
        return None
    t = fault
    last = max((r["start"] for r in result.ok), default=0.0)
    while t + window <= last:
        rate = result.hit_rate(t, t + window)
        if rate is not None and rate >= 0.95 * before:
            return max(0.0, t - restart)
        t += 0.25
    return None


# ------------------------------------------------------------------------------------ report


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _failed_split(r: Result) -> str:
    if r.fault_at is None:
        return f"{len(r.failed)}"
    in_flight = sum(1 for x in r.failed if x["start"] < r.fault_at)
    return f"{len(r.failed)} ({in_flight} in flight at the fault, {len(r.failed) - in_flight} sent after)"


def print_report(results: Sequence[Result], args: argparse.Namespace) -> None:
    n = {r.run: max(1, len(r.records)) for r in results}
    print()
    for r in results:
        ttft = [x["ttft"] * 1000 for x in r.ok if x["ttft"] is not None]
        print(f"{r.run}: {len(r.ok)}/{len(r.records)} ok, failed {_failed_split(r)}")
        print(
            f"  TTFT p50/p90 {_fmt(percentile(ttft, 50), '.0f')}/{_fmt(percentile(ttft, 90), '.0f')} ms, "
            f"hit rate {_fmt(r.hit_rate(), '.3f')}"
        )
        if r.epp_cpu is not None:
            print(
                f"  EPP CPU (3 replicas): idle {_fmt(r.epp_cpu_idle, '.3f')} cores, under load "
                f"{r.epp_cpu / n[r.run] * 1000:.2f} ms per request"
            )
        if r.redis:
            cpu = r.redis["used_cpu_sys"] + r.redis["used_cpu_user"]
            print(
                f"  Redis: CPU {cpu / n[r.run] * 1e6:.0f} us per request, in "
                f"{r.redis['total_net_input_bytes'] / n[r.run]:.0f} B / out "
                f"{r.redis['total_net_output_bytes'] / n[r.run]:.0f} B per request"
            )
        if r.redis_idle:
            cpu = r.redis_idle["used_cpu_sys"] + r.redis_idle["used_cpu_user"]
            print(
                f"  Redis idle (the sync rounds alone): CPU {cpu * 1000:.1f} ms/s, in "
                f"{r.redis_idle['total_net_input_bytes'] / 1000:.1f} kB/s / out "
                f"{r.redis_idle['total_net_output_bytes'] / 1000:.1f} kB/s"
            )
        if r.lag_p99 is not None or r.sync_p99 is not None:
            print(
                f"  sync lag p99 <= {_fmt(r.lag_p99, '.0f', 1000)} ms, round trip p99 <= "
                f"{_fmt(r.sync_p99, '.1f', 1000)} ms (histogram bucket bounds)"
            )
        if r.run == "redis-restart":
            up = args.kill_at + args.redis_down
            print(
                f"  every replica connected with its peers {_fmt(r.reconnected_after, '.1f')} s after the "
                f"restart; hit rate back {_fmt(r.hit_back_after, '.2f')} s after it (2 s before the kill "
                f"{_fmt(r.hit_rate(args.kill_at - 2, args.kill_at), '.3f')}, Redis down "
                f"{_fmt(r.hit_rate(args.kill_at, up), '.3f')}, "
                f"2 s after {_fmt(r.hit_rate(up, up + 2), '.3f')})"
            )
        if r.streams:
            print(f"  ext_proc streams per replica (Envoy): {r.streams}")
        for note in r.notes:
            print(f"  {note}")
        for example in sorted({x["error"] for x in r.failed})[:3]:
            print(f"  error: {example}")
    by = {r.run: r for r in results}
    off, on = by.get("syncer-off"), by.get("syncer-on")
    if off is not None and on is not None and off.epp_cpu and on.epp_cpu is not None:
        per_off = off.epp_cpu / n[off.run]
        per_on = on.epp_cpu / n[on.run]
        print(
            f"\nsyncer: EPP CPU per request {per_off * 1000:.2f} -> {per_on * 1000:.2f} ms "
            f"({(per_on / per_off - 1) * 100:+.0f} %); idle {_fmt(off.epp_cpu_idle, '.3f')} -> "
            f"{_fmt(on.epp_cpu_idle, '.3f')} cores (the sync rounds: {args.replicas} replicas x 10/s)"
        )
        if off.epp_cpu_idle is not None and on.epp_cpu_idle is not None:
            # What is left once the rounds' idle cost over the load's wall time is taken out.
            busy_off = off.epp_cpu - off.epp_cpu_idle * off.wall
            busy_on = on.epp_cpu - on.epp_cpu_idle * on.wall
            print(
                f"  beyond the idle rounds: {busy_off / n[off.run] * 1000:.2f} -> "
                f"{busy_on / n[on.run] * 1000:.2f} ms per request "
                f"({(busy_on / busy_off - 1) * 100:+.0f} %)"
            )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="runs, in order (default all)")
    add("--replicas", type=int, default=3, help="EPP replicas (default 3)")
    add("--sims", type=int, default=4, help="simulators (default 4)")
    add("--rate", type=float, default=20.0, help="requests per second, Poisson (default 20)")
    add("--duration", type=float, default=10.0, help="seconds of arrivals (default 10)")
    add("--kill-at", type=float, default=5.0, help="seconds into the load the fault starts (default 5)")
    add("--redis-down", type=float, default=1.0, help="redis-restart: seconds Redis stays down (default 1)")
    add("--idle", type=float, default=3.0, help="syncer runs: seconds of idle CPU measured (default 3)")
    add("--groups", type=int, default=8, help="groups sharing a system prompt (default 8)")
    add("--prompt-tokens", type=int, default=1000, help="system prompt length in tokens (default 1000)")
    add("--max-tokens", type=int, default=16, help="max_tokens per request (default 16)")
    add("--seed", type=int, default=1, help="workload seed (default 1)")
    args = parser.parse_args(argv)
    if args.replicas < 2 or not 0 < args.kill_at < args.duration:
        parser.error("--replicas must be at least 2 and --kill-at within --duration")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sim_args = default_sim_args(sim_help(), max_tokens=args.max_tokens)
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"{args.replicas} EPP replicas, {args.sims} sims ({shlex.join(sim_args)}), {args.groups} groups x "
        f"~{args.prompt_tokens}-token system prompt, {args.rate:g} streaming req/s for {args.duration:g} s "
        f"(seed {args.seed}); faults at {args.kill_at:g} s",
        flush=True,
    )
    runners = {
        "syncer-off": run_cost,
        "syncer-on": run_cost,
        "kill-replica-open": run_kill_replica,
        "kill-replica-closed": run_kill_replica,
        "redis-restart": run_redis_restart,
    }
    results = []
    with tempfile.TemporaryDirectory(prefix="epp-bench-replicas-") as tmp:
        for name in args.runs:
            t = time.monotonic()
            results.append(runners[name](name, Path(tmp), args, sim_args))
            print(f"  {name}: done in {time.monotonic() - t:.0f} s", flush=True)
    print_report(results, args)
    if len(results) > 1:
        errors = [len(r.failed) for r in results]
        print(f"\nfailed requests per run: {dict(zip(args.runs, errors, strict=True))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
