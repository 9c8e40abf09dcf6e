"""Routing quality: the EPP's scheduling configs side by side (``make bench-routing``).

The same seeded workload through Envoy, the EPP and fresh ``epp sim`` servers per config; TTFT,
throughput and the fleet's prefix-cache hit rate (set-up and figures in docs/benchmarks.md).
``--scenario groups``: groups sharing a system prompt, default scheduling against (random)
round-robin. ``--scenario cache-pressure``: interleaved multi-turn sessions whose working set is
twice what the simulators' KV caches hold; random, approximate and precise prefix-cache routing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _peers
from bench._workdir import run_in_workdir
from epp.dev import stack
from epp.dev.envoy.bootstrap import envoy_bootstrap
from epp.dev.stack.files import DEFAULT_WEIGHTS
from epp.dev.stack.redis_server import RedisServer

MODEL = "demo"
LOADGEN = Path(__file__).with_name("_loadgen.py")
KV_INDEX_BENCH = Path(__file__).with_name("kv_index.py")
READY_TIMEOUT = 60.0
CHARS_PER_TOKEN = 4  # the EPP's token estimate (the simulator tokenizes for real: about as many)

# epp has no round-robin picker: random-picker alone is the closest stand-in (see docs/plugins.md).
ROUND_ROBIN_LABEL = "round-robin*"
ROUND_ROBIN_CONFIG: dict[str, Any] = {
    "plugins": [{"name": "picker", "type": "random-picker"}],
    "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "picker"}]}],
}
CONFIGS: dict[str, dict[str, Any] | None] = {ROUND_ROBIN_LABEL: ROUND_ROBIN_CONFIG, "default": None}

# Precise prefix-cache routing: real token ids from the simulators' own tokenizer, the blocks the
# simulators report in KV events; otherwise the default profile's scorers and weights.
PRECISE_CONFIG: dict[str, Any] = stack.one_profile_config(
    [
        {"type": "token-producer", "parameters": {"modelName": MODEL, "local": {"path": ""}}},
        {
            "type": "precise-prefix-cache-producer",
            "parameters": {"tokenProcessorConfig": {"blockSizeTokens": 16}, "speculativeIndexing": True},
        },
        {
            "type": "prefix-cache-scorer",
            "parameters": {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"},
        },
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
    DEFAULT_WEIGHTS,
)
PRESSURE_CONFIGS: dict[str, dict[str, Any] | None] = {
    "random": ROUND_ROBIN_CONFIG,
    "default": None,
    "precise": PRECISE_CONFIG,
}
# A prefix hit weighed against the prefill queued ahead of it, bounded load, hashed tie-breaks.
PREFILL_COST_CONFIG: dict[str, Any] = stack.one_profile_config(
    [
        {"type": "prefill-cost-scorer"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
    {"prefill-cost-scorer": 4, "queue-scorer": 1, "kv-cache-utilization-scorer": 1, "max-score-picker": None},
)
CONFIGS["prefill-cost"] = PREFILL_COST_CONFIG
PRESSURE_CONFIGS["prefill-cost"] = PREFILL_COST_CONFIG
# The default profile with the approximate index sized by its fixed default (31,250 blocks per
# endpoint) instead of each engine's reported cache size (autoTune): it remembers sessions longer.
PRESSURE_CONFIGS["approx-fixed-lru"] = stack.one_profile_config(
    [
        {"type": "approx-prefix-cache-producer", "parameters": {"autoTune": False, "blockSizeTokens": 16}},
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
    DEFAULT_WEIGHTS,
)
# Prefix affinity under a bounded load, cold prompts spread (prefix-spread-scorer alone).
SPREAD_CONFIG: dict[str, Any] = stack.one_profile_config(
    [{"type": "prefix-spread-scorer"}, {"type": "max-score-picker"}],
    {"prefix-spread-scorer": None, "max-score-picker": None},
)
CONFIGS["spread"] = SPREAD_CONFIG
PRESSURE_CONFIGS["spread"] = SPREAD_CONFIG
# The reference's default profile (epp's default until prefix-spread-scorer replaced it), written out.
REFERENCE_DEFAULT_CONFIG: dict[str, Any] = stack.one_profile_config(
    [
        {"type": "approx-prefix-cache-producer"},
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
    DEFAULT_WEIGHTS,
)
CONFIGS["ref-default"] = REFERENCE_DEFAULT_CONFIG
PRESSURE_CONFIGS["ref-default"] = REFERENCE_DEFAULT_CONFIG
PRESSURE_CONFIGS["approximate"] = REFERENCE_DEFAULT_CONFIG  # its name in earlier runs
SCENARIO_CONFIGS = {"groups": CONFIGS, "burst": CONFIGS, "cache-pressure": PRESSURE_CONFIGS}


def config_for(label: str, scenario: str) -> dict[str, Any] | None:
    """The EPP config of ``label``; the precise one gets the simulators' tokenizer directory."""
    config = SCENARIO_CONFIGS[scenario][label]
    if config is PRECISE_CONFIG:
        from epp.tokenization import DEFAULT_TOKENIZER_DIR

        config = json.loads(json.dumps(config))
        config["plugins"][0]["parameters"]["local"]["path"] = str(DEFAULT_TOKENIZER_DIR)
    return config


def working_set_tokens(args: argparse.Namespace) -> int:
    """Tokens of every session's last turn (its whole history), with the simulators' tokenizer."""
    from bench import _loadgen
    from epp.tokenization import DEFAULT_TOKENIZER_DIR, load_tokenizer

    tok = load_tokenizer(DEFAULT_TOKENIZER_DIR)
    sessions = _loadgen.plan_sessions(
        system_groups=args.shared_systems,
        sessions=args.sessions,
        turns=args.turns,
        rate=args.rate,
        system_chars=args.prompt_tokens * CHARS_PER_TOKEN,
        turn_chars=args.turn_chars,
        seed=args.seed,
    )
    return sum(len(tok.chat_ids(_loadgen.session_messages(s, args.turns - 1))) for s in sessions)


PREFILL_FLAG = "--prefill-time-per-token"


# ------------------------------------------------------------------------------------ simulator


def sim_help() -> str:
    out = subprocess.run(
        stack.python_argv("sim", "--help"), capture_output=True, text=True, timeout=60, check=False
    )
    return out.stdout


def sim_has_prefix_cache(help_text: str | None = None) -> bool:
    """True when ``epp sim`` has the vLLM-like engine (prefix cache, per-token prefill)."""
    return has_flag(sim_help() if help_text is None else help_text, PREFILL_FLAG)


def default_sim_args(help_text: str, *, max_tokens: int) -> list[str]:
    """Simulator flags for the benchmark, limited to the flags this ``epp sim`` has.

    With the vLLM-like engine (time-scale 1): prefill costs 10 ms + 0.3 ms per uncached prompt token,
    so a cold 3,000-token system prompt takes ~0.9 s and a cached one ~20 ms (only the question and
    the last partial block are computed); 10 ms per output token; latencies grow up to 2x with a full
    batch of 4 (``--time-factor-under-load 1``). 768 blocks x 16 tokens = 12,288 tokens of KV cache
    hold about 4 of the 8 system prompts (~188 blocks each): a simulator that sees every group
    (random routing) keeps evicting them and, at 6 req/s over 4 sims, runs mostly cold prefills of
    ~0.9 s each, so requests queue; one that sees 2 groups (prefix routing) keeps them.
    """
    flags: list[tuple[str, str]] = [
        ("--time-to-first-token", "10"),
        (PREFILL_FLAG, "0.3"),
        ("--inter-token-latency", "10"),
        ("--time-factor-under-load", "1"),
        ("--max-tokens", str(max_tokens)),
        ("--max-num-seqs", "4"),
        ("--kv-cache-size", "768"),
        ("--block-size", "16"),
    ]
    return [x for flag, value in flags if has_flag(help_text, flag) for x in (flag, value)]


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


# ------------------------------------------------------------------------------------ metrics

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def counter_sum(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"] == name:
            total += float(m["value"])
    return total


def scrape_cache(ports: Sequence[int]) -> tuple[float, float]:
    """(prefix-cache hits, queries) summed over the simulators on ``ports``, in tokens."""
    hits = queries = 0.0
    for port in ports:
        text = _get(f"http://127.0.0.1:{port}/metrics")
        hits += counter_sum(text, "vllm:prefix_cache_hits_total")
        queries += counter_sum(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


# ------------------------------------------------------------------------------------- the stack


class Stack(stack.LocalStack):
    """``epp run``'s stack (N sims + ``epp serve`` with ``config`` + Envoy) on free ports."""

    def __init__(
        self,
        workdir: Path,
        sims: int,
        sim_args: Sequence[str],
        config: dict[str, Any] | None,
        *,
        kv_events: bool = False,
        gateways: int = 1,
    ):
        opts = stack.StackOptions.on_free_ports(
            sims,
            kv_events=kv_events,
            model=MODEL,
            sim_args=list(sim_args),
            config=config,
            epp_args=["--log-level", "warning"],
            ready_timeout=READY_TIMEOUT,
        )
        super().__init__(opts, workdir)
        self.gateways = gateways
        self._extra_ports: list[int] = []

    @property
    def sim_ports(self) -> list[int]:
        return self.opts.sim_ports

    @property
    def urls(self) -> list[str]:
        """Every gateway's listener: the stack's Envoy, then the extra ones."""
        return [self.url, *(f"http://127.0.0.1:{port}" for port in self._extra_ports)]

    def start(self, abort: Callable[[], bool] | None = None) -> None:
        """The stack, plus ``gateways - 1`` more Envoys, each with its own EPP (a sidecar
        deployment's gateway replicas): same simulators, same config, nothing shared between EPPs."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        super().start(abort)
        for g in range(1, self.gateways):
            self._start_gateway(g)

    def _start_gateway(self, g: int) -> None:
        o = self.opts
        port, admin, grpc_port, health, metrics = stack.free_ports(5)
        config = stack.epp_config(self.endpoints_file, o.config)
        epp = self.start_epp(
            f"epp-{g}",
            grpc_port=grpc_port,
            health_port=health,
            metrics_port=metrics,
            config=config,
            extra=o.epp_args,
        )
        bootstrap = envoy_bootstrap(
            listen_port=port,
            admin_port=admin,
            extproc_port=grpc_port,
            body_mode=o.body_mode,
            fallback_endpoints=[f"127.0.0.1:{p}" for p in o.sim_ports],
        )
        envoy = self.start_envoy(f"envoy-{g}", bootstrap, log_level=o.envoy_log_level)
        self.wait_epp(epp, health)
        self.wait_envoy(envoy, admin)
        self.wait(
            f"GET /v1/models through envoy-{g}",
            stack.http_ok(f"http://127.0.0.1:{port}/v1/models"),
            children=[epp, envoy],
        )
        self._extra_ports.append(port)

    def alive(self) -> None:
        dead = self.supervisor.exited()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited ({dead.returncode()}):\n{dead.tail(20)}")

    def __enter__(self) -> Stack:
        super().__enter__()
        return self


# ------------------------------------------------------------------------------------------ bench


@dataclass
class Result:
    label: str
    requests: int
    completed: int
    errors: int
    ttft_ms: list[float]
    output_tokens: int
    wall: float
    cache_hits: float
    cache_queries: float
    groups_spread: float  # mean number of distinct pods a group's requests went to
    per_pod: dict[str, int] = field(default_factory=dict)  # requests served, by pod
    first_error: str = ""
    hit_rate_after: float | None = None  # hit rate of the requests sent after an EPP restart

    @property
    def hit_rate(self) -> float | None:
        return self.cache_hits / self.cache_queries if self.cache_queries > 0 else None


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def loadgen_argv(url: str, args: argparse.Namespace, output: Path) -> list[str]:
    """The load generator's command line; ``url`` may list several gateways, comma-separated."""
    scenario: list[str] = []
    if args.scenario == "cache-pressure":
        scenario = [
            "--scenario",
            "sessions",
            "--sessions",
            str(args.sessions),
            "--turns",
            str(args.turns),
            "--turn-chars",
            str(args.turn_chars),
            "--think-time",
            str(args.think_time),
            "--system-groups",
            str(args.shared_systems),
        ]
    return [
        sys.executable,
        str(LOADGEN),
        "--url",
        url,
        "--rate",
        str(args.rate),
        "--requests",
        str(args.requests),
        "--groups",
        str(args.groups),
        "--prompt-chars",
        str(args.prompt_tokens * CHARS_PER_TOKEN),
        "--max-tokens",
        str(args.max_tokens),
        "--model",
        MODEL,
        "--seed",
        str(args.seed),
        "--output",
        str(output),
        *scenario,
    ]


def _per_pod(recs: Sequence[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        out[r["pod"]] = out.get(r["pod"], 0) + 1
    return out


def _pod_spread(r: Result, sims: int) -> str:
    """``max/min`` requests per pod (a pod that served none counts 0) and their ratio."""
    counts = sorted(r.per_pod.values(), reverse=True) + [0] * max(0, sims - len(r.per_pod))
    if not counts:
        return "-"
    hi, lo = counts[0], counts[-1]
    return f"{hi}/{lo} ({hi / lo:.2f})" if lo else f"{hi}/0 (inf)"


def summarize(label: str, data: dict[str, Any], hits: float, queries: float) -> Result:
    recs = data["requests"]
    ok = [r for r in recs if not r["error"]]
    errors = [r for r in recs if r["error"]]
    pods: dict[int, set[str]] = {}
    for r in ok:
        pods.setdefault(r["group"], set()).add(r["pod"])
    return Result(
        label=label,
        requests=len(recs),
        completed=len(ok),
        errors=len(errors),
        ttft_ms=[r["ttft"] * 1000 for r in ok if r["ttft"] is not None],
        output_tokens=sum(r["output_tokens"] for r in ok),
        wall=float(data["wall_seconds"]),
        cache_hits=hits,
        cache_queries=queries,
        groups_spread=statistics.mean(len(p) for p in pods.values()) if pods else 0.0,
        per_pod=_per_pod(ok),
        first_error=errors[0]["error"] if errors else "",
    )


def run_config(
    label: str,
    config: dict[str, Any] | None,
    args: argparse.Namespace,
    sim_args: list[str],
    workdir: Path,
    gateways: int = 1,
    *,
    shared: bool = False,
) -> Result:
    kv_events = args.scenario == "cache-pressure"
    redis_server: RedisServer | None = None
    if shared:  # the gateways' EPPs share their routing state through one private redis-server
        workdir.mkdir(parents=True, exist_ok=True)
        redis_server = RedisServer(workdir).start()
        config = with_syncer(config, redis_server.address)
    try:
        return _run_stack(label, config, args, sim_args, workdir, gateways, kv_events)
    finally:
        if redis_server is not None:
            redis_server.stop()


def with_syncer(config: dict[str, Any] | None, address: str) -> dict[str, Any]:
    """``config`` (None: the default profile) with a ``redis-syncer`` at ``address`` wired in."""
    out: dict[str, Any] = json.loads(json.dumps(config)) if config is not None else {}
    out.setdefault("plugins", []).append(
        {"name": "shared-state", "type": "redis-syncer", "parameters": {"address": address}}
    )
    data_layer = out.setdefault("dataLayer", {})
    if out.get("apiVersion", "llm-d.ai/v1") == "llm-d.ai/v1":
        data_layer["crossReplica"] = {"syncerPluginRef": "shared-state", "syncInterval": "100ms"}
    else:
        data_layer["crossReplicaSyncerPluginRef"] = "shared-state"
        data_layer["crossReplicaSyncInterval"] = "100ms"
    return out


def _run_stack(
    label: str,
    config: dict[str, Any] | None,
    args: argparse.Namespace,
    sim_args: list[str],
    workdir: Path,
    gateways: int,
    kv_events: bool,
) -> Result:
    with Stack(workdir, args.sims, sim_args, config, kv_events=kv_events, gateways=gateways) as st:
        return _drive(label, st, args, workdir)


def run_peer(
    label: str, peer: _peers.Peer, python: Path, args: argparse.Namespace, sim_args: list[str], workdir: Path
) -> Result | None:
    """The workload through ``peer`` over fresh simulators; None (and why, printed) when it cannot start."""
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        with _peers.PeerStack(workdir, peer, python, args.sims, sim_args, MODEL) as st:
            return _drive(label, st, args, workdir)
    except (stack.ChildExited, TimeoutError, OSError) as e:
        print(f"  {label}: could not run: {str(e)[-400:]}", flush=True)
        return None


def _drive(label: str, st: Stack | _peers.PeerStack, args: argparse.Namespace, workdir: Path) -> Result:
    """Send the workload through ``st``'s gateway(s); the result with the simulators' hit counters."""
    h0, q0 = scrape_cache(st.sim_ports)
    output = workdir / "loadgen.json"
    argv = loadgen_argv(",".join(st.urls), args, output)
    print(f"  {label}: {shlex.join(argv[1:])}", flush=True)
    t0 = time.monotonic()
    restart = (
        _Restart(st, t0 + args.restart_epp_after)
        if args.restart_epp_after > 0 and isinstance(st, Stack)
        else None
    )
    proc = subprocess.Popen(argv)
    deadline = t0 + args.requests / max(args.rate, 0.1) + 600
    while proc.poll() is None:
        if restart is not None:
            restart.step()
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("load generator timed out")
        time.sleep(0.1)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator exited with status {proc.returncode}")
    st.alive()
    h1, q1 = scrape_cache(st.sim_ports)
    data = json.loads(output.read_text())
    result = summarize(label, data, h1 - h0, q1 - q0)
    if restart is not None:
        result.hit_rate_after = restart.hit_rate_after(data, t0)
    print(
        f"  {label}: {result.completed}/{result.requests} ok in {time.monotonic() - t0:.1f} s, "
        f"{result.errors} errors{f' (first: {result.first_error})' if result.first_error else ''}",
        flush=True,
    )
    return result


class _Restart:
    """Kills the first gateway's EPP (SIGKILL) at ``at`` (monotonic) and starts it again on the same
    ports, as a crash or a rolling update would; Envoy reconnects by itself. ``step`` runs on the
    main thread (children get a parent-death signal when the thread that started them ends)."""

    def __init__(self, st: Stack, at: float) -> None:
        self.st = st
        self.at = at
        self.ready_at: float | None = None

    def step(self) -> None:
        if self.ready_at is not None or time.monotonic() < self.at:
            return
        epp = self.st.epp
        assert epp is not None
        killed = time.monotonic()
        os.killpg(epp.pid, signal.SIGKILL)
        epp.respawn()
        self.st.wait_epp(epp, self.st.opts.health_port)
        self.ready_at = time.monotonic()
        print(f"  EPP killed, ready again {self.ready_at - killed:.1f} s later", flush=True)

    def hit_rate_after(self, data: dict[str, Any], t0: float) -> float | None:
        """Cached over prompt tokens (from the usage chunks) of the requests sent once it was ready."""
        if self.ready_at is None:
            return None
        since = self.ready_at - t0
        recs = [r for r in data["requests"] if not r["error"] and r["start"] >= since]
        prompt = sum(r["prompt_tokens"] for r in recs)
        return sum(r["cached_tokens"] for r in recs) / prompt if prompt else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def print_table(results: Sequence[Result], sims: int) -> None:
    rows: list[tuple[str, Callable[[Result], str]]] = [
        ("TTFT mean (ms)", lambda r: _fmt(statistics.fmean(r.ttft_ms) if r.ttft_ms else None, ".0f")),
        ("TTFT p50 (ms)", lambda r: _fmt(percentile(r.ttft_ms, 50), ".0f")),
        ("TTFT p90 (ms)", lambda r: _fmt(percentile(r.ttft_ms, 90), ".0f")),
        ("output tokens/s", lambda r: _fmt(r.output_tokens / r.wall if r.wall else None, ".1f")),
        ("requests/s", lambda r: _fmt(r.completed / r.wall if r.wall else None, ".2f")),
        ("errors", lambda r: f"{r.errors}/{r.requests}"),
        ("prefix-cache hit rate", lambda r: _fmt(r.hit_rate, ".3f")),
        ("  (hit / queried tokens)", lambda r: f"{r.cache_hits:.0f}/{r.cache_queries:.0f}"),
        ("pods per group (mean)", lambda r: _fmt(r.groups_spread, ".2f")),
        ("requests per pod max/min", lambda r: _pod_spread(r, sims)),
    ]
    if any(r.hit_rate_after is not None for r in results):
        rows.append(("hit rate after EPP restart", lambda r: _fmt(r.hit_rate_after, ".3f")))
    width = max(16, *(len(r.label) + 2 for r in results))
    print(f"\n{'':<26}" + "".join(f"{r.label:>{width}}" for r in results))
    for name, cell in rows:
        print(f"{name:<26}" + "".join(f"{cell(r):>{width}}" for r in results))
    if any(r.label == ROUND_ROBIN_LABEL for r in results):
        print(f"{ROUND_ROBIN_LABEL}: random-picker only (epp has no round-robin picker)")
    if not any(r.cache_hits for r in results):
        print("note: no prefix-cache hits counted: this epp sim does not model prefix caching")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--sims", type=int, default=4, help="number of simulators (default 4)")
    add("--groups", type=int, default=8, help="groups sharing a system prompt (default 8)")
    add("--prompt-tokens", type=int, default=3000, help="system prompt length in tokens (default 3000)")
    add("--rate", type=float, default=6.0, help="Poisson arrival rate in requests/s (default 6)")
    add("--requests", type=int, default=240, help="requests per config (default 240, ~40 s at 6/s)")
    add("--max-tokens", type=int, default=16, help="max_tokens per request (default 16)")
    add("--seed", type=int, default=1, help="workload seed (default 1)")
    add(
        "--sim-args",
        default="",
        help="extra flags for every simulator, one shell-quoted string (appended after the defaults)",
    )
    add("--time-scale", type=float, default=None, help="simulator --time-scale (default: the sim's own)")
    add(
        "--configs",
        nargs="+",
        default=None,
        choices=sorted({*CONFIGS, *PRESSURE_CONFIGS}),
        help="configs to run, in order (default: all of the scenario's)",
    )
    add(
        "--scenario",
        choices=("groups", "burst", "cache-pressure", "agentic"),
        default="groups",
        help="workload (default groups; burst: 48 requests of the groups at once, cold caches; agentic: "
        "cache-pressure's sessions as agents of 4 kinds sharing their system prompt, short tool-call "
        "turns, 0.2 s think time, the fleet's cache the size of the sessions' histories)",
    )
    add(
        "--gateways",
        type=int,
        nargs="+",
        default=None,
        help="gateway replicas (Envoy + its own EPP each; requests spread at random over them) to run "
        "every config with (default: 1; cache-pressure: 1 2)",
    )
    add(
        "--restart-epp-after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="kill -9 the (first) EPP this long into the load and start it again (default 0: never)",
    )
    add("--sessions", type=int, default=24, help="cache-pressure: conversations (default 24)")
    add("--turns", type=int, default=6, help="cache-pressure: turns per conversation (default 6)")
    add("--turn-chars", type=int, default=1600, help="cache-pressure: user message characters (default 1600)")
    add("--think-time", type=float, default=0.5, help="cache-pressure: mean think time in s (default 0.5)")
    add(
        "--cache-fraction",
        type=float,
        default=0.5,
        help="cache-pressure: the fleet's KV cache as a fraction of the working set (default 0.5)",
    )
    add(
        "--syncer",
        choices=("off", "on", "both"),
        default="off",
        help="with --gateways above 1: the gateways' EPPs share state through a private redis-server "
        "(redis-syncer): off, on, or both runs (default off)",
    )
    add(
        "--peers",
        nargs="*",
        default=list(_peers.PEERS),
        choices=sorted(_peers.PEERS),
        help="peer routers to run on the same simulators and workload, from .bench-venv (installed on "
        "first use; default: all); none with --no-peers",
    )
    add("--no-peers", action="store_true", help="run epp's configs only")
    add(
        "--short",
        action="store_true",
        help="a short run: fewer requests (groups: 96; burst as is; cache-pressure: 12 sessions x 4 turns)",
    )
    add("--keep-logs", action="store_true", help="keep the work directory (logs, configs) on success")
    args = parser.parse_args(argv)
    if min(args.sims, args.groups, args.requests, args.prompt_tokens) < 1 or args.rate <= 0:
        parser.error("--sims, --groups, --requests, --prompt-tokens and --rate must be positive")
    if args.no_peers:
        args.peers = []
    args.shared_systems = 0
    if args.scenario == "agentic":  # sessions of agents sharing their kind's prompt, short tool turns
        args.scenario, args.shared_systems = "cache-pressure", 4
        args.turn_chars, args.think_time, args.turns = 400, 0.2, 8
        if "--cache-fraction" not in " ".join(argv):
            args.cache_fraction = 1.0
    if args.short and args.scenario == "groups":
        args.requests = min(args.requests, 96)
    if args.short and args.scenario == "cache-pressure":
        args.sessions, args.turns = min(args.sessions, 12), min(args.turns, 4)
    if args.scenario == "burst":
        args.requests, args.rate = 48, 1000.0
    scenario_configs = SCENARIO_CONFIGS[args.scenario]
    if args.configs is None:
        args.configs = list(scenario_configs)
    unknown = [c for c in args.configs if c not in scenario_configs]
    if unknown:
        parser.error(
            f"--configs: {', '.join(unknown)} not in scenario {args.scenario} ({', '.join(scenario_configs)})"
        )
    if args.scenario == "cache-pressure":
        args.requests = args.sessions * args.turns
    if args.gateways is None:
        args.gateways = [1, 2] if args.scenario == "cache-pressure" else [1]
    if min(args.gateways) < 1:
        parser.error("--gateways must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    help_text = sim_help()
    engine = sim_has_prefix_cache(help_text)
    sim_args = default_sim_args(help_text, max_tokens=args.max_tokens)
    if args.scenario == "cache-pressure":
        working_set = working_set_tokens(args)
        blocks = max(1, int(args.cache_fraction * working_set / args.sims / 16))
        sim_args = _replace_flag(sim_args, "--kv-cache-size", str(blocks))
        print(
            f"cache-pressure: {args.sessions} sessions x {args.turns} turns, "
            f"working set {working_set} tokens; "
            f"each of {args.sims} sims caches {blocks} blocks x 16 tokens "
            f"({args.cache_fraction:g} of the working set over the fleet)"
        )
    if args.time_scale is not None:
        sim_args += ["--time-scale", str(args.time_scale)]
    sim_args += shlex.split(args.sim_args)
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-routing-"))
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    if args.scenario == "cache-pressure":
        workload = (
            f"{args.sessions} sessions x {args.turns} turns (~{args.prompt_tokens}-token system prompt, "
            f"{args.turn_chars}-character questions), sessions starting at {args.rate:g}/s"
        )
    else:
        workload = (
            f"{args.groups} groups x ~{args.prompt_tokens}-token system prompt, "
            f"{args.requests} requests at {args.rate:g} req/s"
        )
    print(
        f"{args.sims} sims, {workload} (Poisson, seed {args.seed}), max_tokens {args.max_tokens}, "
        f"gateways {' and '.join(map(str, args.gateways))}, work dir {workdir}"
    )
    print(f"sim args: {shlex.join(sim_args)}")
    if not engine:
        print(
            f"note: this epp sim has no {PREFILL_FLAG} (no prefix-cache model): hit counters stay 0 and "
            "TTFT does not depend on caching; the run only checks the plumbing"
        )
    if args.scenario == "cache-pressure":
        print(
            "random: random-picker only; default: the EPP's default profile (prefix-spread-scorer over "
            "the approximate prefix index); approximate, ref-default: the reference's default profile "
            "(approximate prefix index + queue + kv-cache scorers); precise: those scorers with the "
            "prefix match from KV events; "
            "xN: N gateway replicas, each Envoy with its own EPP, requests spread at random over them",
            flush=True,
        )
    else:
        print(
            f"{ROUND_ROBIN_LABEL}: epp has no round-robin picker; random-picker alone (uniform random "
            "choice) stands in for it. default: the EPP's default profile (prefix-spread-scorer); "
            "ref-default: the reference's default profile (prefix + queue + kv-cache scorers)",
            flush=True,
        )
    results: list[Result] = []

    def run() -> int:
        syncer_runs = {"off": [False], "on": [True], "both": [False, True]}[args.syncer]
        for gateways in args.gateways:
            for label in args.configs:
                for shared in syncer_runs if gateways > 1 else [False]:
                    name = label if gateways == 1 else f"{label} x{gateways}"
                    name += " +redis" if shared else ""
                    safe = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
                    config = config_for(label, args.scenario)
                    results.append(
                        run_config(name, config, args, sim_args, workdir / safe, gateways, shared=shared)
                    )
        if args.peers:
            python, problems = _peers.ensure_venv([_peers.PEERS[p].package for p in args.peers])
            for name in args.peers:
                peer = _peers.PEERS[name]
                if python is None or peer.package in problems:
                    print(f"  {name}: not run: {problems.get(peer.package, 'no bench venv')}", flush=True)
                    continue
                result = run_peer(f"{name} (cache_aware)", peer, python, args, sim_args, workdir / name)
                if result is not None:
                    results.append(result)
        return 0

    def report() -> None:
        print_table(results, args.sims)
        if args.scenario == "cache-pressure" and "precise" in args.configs:
            print(
                "\nKV-event ingestion and index memory (bench/kv_index.py, 8 endpoints x 50k blocks):",
                flush=True,
            )
            subprocess.run([sys.executable, str(KV_INDEX_BENCH)], check=False, timeout=600)

    return run_in_workdir(
        workdir,
        run,
        errors=(RuntimeError, TimeoutError, OSError, subprocess.SubprocessError),
        keep_logs=args.keep_logs,
        report=report,
    )


if __name__ == "__main__":
    sys.exit(main())
