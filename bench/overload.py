"""Overload and fairness: a steady tenant, a flooding tenant and sheddable traffic (``make bench-overload``).

Fresh ``epp sim`` servers, ``epp serve`` in InferencePool mode (a fake Kubernetes API serving the
pool, the pods and the InferenceObjectives that give priorities) and Envoy per run. The fleet's
capacity is measured first (closed loop), then each run drives Poisson arrivals at fractions of it:
``alone`` (the steady tenant only), ``no-fc`` (everything, the EPP without flow control), ``fc``
(everything, a flow-control config), ``fc-fair`` (``fc`` with ``fair-share-fairness-policy``
instead of round robin) and ``fc-stale`` (``fc`` with a slow metrics scrape). Per run
and tenant: client-side TTFT, completions, rejections by status and dropped reason; the simulators'
exact peak queues; the EPP's flow-control and latency-predictor metrics; then the target checks.
Set-up and how to read the tables: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._workdir import run_in_workdir
from epp.dev import stack
from epp.dev.envoy.bootstrap import envoy_bootstrap
from epp.framework.wire import FAIRNESS_HEADER, LLM_D_FAIRNESS_HEADER, OBJECTIVE_HEADER
from tests.fakekube import FakeKube, objects

MODEL = "demo"
NS = "bench"
POOL = "pool"
TRAFFIC = Path(__file__).with_name("_overload_traffic.py")
READY_TIMEOUT = 60.0
HOST_BASE = 110  # sim i listens on 127.0.0.(HOST_BASE + i): one IP per pod, as in a cluster
SHEDDABLE_OBJECTIVE = "background"
SHEDDABLE_PRIORITY = -1
CALIBRATION = "calibration"


@dataclass(frozen=True)
class Tenant:
    name: str
    fairness_id: str
    priority: int
    objective: str = ""

    def headers(self) -> dict[str, str]:
        out = {LLM_D_FAIRNESS_HEADER: self.fairness_id}
        if self.objective:
            out[OBJECTIVE_HEADER] = self.objective
        return out


TENANTS = (
    Tenant("steady", "tenant-steady", 0),
    Tenant("flood", "tenant-flood", 0),
    Tenant("sheddable", "tenant-batch", SHEDDABLE_PRIORITY, SHEDDABLE_OBJECTIVE),
)
TENANT = {t.name: t for t in TENANTS}


# The flow-control runs: fair queuing between the tenants in band 0, a band below for sheddable
# requests that give way to blocked band-0 demand (enableEviction), placement by the EPP's own
# in-flight counts. ``fc`` gates dispatch on the engines' batch size (concurrency-detector,
# maxConcurrency = --max-num-seqs: nothing waits in an engine); ``fc-stale`` on scraped metrics
# (utilization-detector, queueDepthThreshold 1) that are stale between 15 s scrapes, where the
# in-flight credit stands in for them.
def fc_config(
    max_num_seqs: int, *, scraped: bool, fairness: str = "round-robin-fairness-policy"
) -> dict[str, Any]:
    gate: dict[str, Any] = (
        {"name": "gate", "type": "utilization-detector", "parameters": {"queueDepthThreshold": 1}}
        if scraped
        else {"name": "gate", "type": "concurrency-detector", "parameters": {"maxConcurrency": max_num_seqs}}
    )
    return {
        "featureGates": ["flowControl"],
        "plugins": [
            {"name": "round-robin", "type": fairness},
            gate,
            {"type": "active-request-scorer"},
            {"type": "max-score-picker"},
            # learns TTFT/TPOT from the responses: its error is printed (no scorer uses it here)
            {"type": "predicted-latency-producer", "parameters": {"streamingMode": True}},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "active-request-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
        "flowControl": {
            "defaultRequestTTL": "10s",
            "enableEviction": True,
            "priorityBands": [
                {"priority": 0, "fairnessPolicyRef": "round-robin"},
                {"priority": SHEDDABLE_PRIORITY},
            ],
            "saturationDetector": {"pluginRef": "gate"},
        },
    }


@dataclass(frozen=True)
class RunSpec:
    name: str
    what: str
    tenants: tuple[str, ...]
    flow_control: bool
    stale: bool = False
    fairness: str = "round-robin-fairness-policy"  # the built-in config's band-0 fairness policy


RUNS = {
    "alone": RunSpec("alone", "the steady tenant alone", ("steady",), False),
    "no-fc": RunSpec("no-fc", "all traffic, no flow control", ("steady", "flood", "sheddable"), False),
    "fc": RunSpec("fc", "all traffic, flow control", ("steady", "flood", "sheddable"), True),
    "fc-fair": RunSpec(
        "fc-fair",
        "all traffic, flow control with fair-share-fairness-policy",
        ("steady", "flood", "sheddable"),
        True,
        fairness="fair-share-fairness-policy",
    ),
    "fc-stale": RunSpec(
        "fc-stale",
        "all traffic, flow control, slow metrics scrape",
        ("steady", "flood", "sheddable"),
        True,
        True,
    ),
}


# ------------------------------------------------------------------------------------ the stack


def sim_args(args: argparse.Namespace) -> list[str]:
    """Fixed latencies (no load factor, no jitter, no prefill cost per token): capacity is exact."""
    return [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--time-to-first-token",
        str(args.ttft_ms),
        "--inter-token-latency",
        str(args.itl_ms),
        "--prefill-time-per-token",
        "0",
        "--time-factor-under-load",
        "0",
        "--max-tokens",
        str(args.output_tokens),
        *shlex.split(args.sim_args),
    ]


def derived_service_seconds(args: argparse.Namespace) -> float:
    """One request's time in an engine slot: the first token, then one per inter-token latency."""
    return (args.ttft_ms + (args.output_tokens - 1) * args.itl_ms) / 1000.0


def derived_capacity(args: argparse.Namespace) -> float:
    """Requests/s the fleet can complete from the sim settings: slots / service time."""
    return args.sims * args.max_num_seqs / max(derived_service_seconds(args), 1e-3)


class OverloadStack(stack.Stack):
    """Sims on their own loopback IPs, a fake API server, ``epp serve --pool-name`` and Envoy."""

    def __init__(
        self,
        workdir: Path,
        args: argparse.Namespace,
        config: dict[str, Any],
        epp_args: Sequence[str],
    ) -> None:
        super().__init__(workdir, ready_timeout=READY_TIMEOUT)
        self.args = args
        self.config = config
        self.epp_args = list(epp_args)
        self.hosts = [f"127.0.0.{HOST_BASE + i}" for i in range(args.sims)]
        self.sim_port = stack.free_port()
        self.port, self.admin_port, self.grpc_port, self.health_port, self.metrics_port = stack.free_ports(5)
        self.kube: FakeKube | None = None
        self.epp: stack.Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def sim_urls(self) -> list[str]:
        return [f"http://{h}:{self.sim_port}" for h in self.hosts]

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        kube = self.kube = FakeKube(bookmark_interval=5.0).start()
        kube.create(objects.inference_pool(NS, (self.sim_port,), name=POOL))
        kube.create(objects.objective(NS, SHEDDABLE_OBJECTIVE, SHEDDABLE_PRIORITY, pool=POOL))
        sims = []
        for i, host in enumerate(self.hosts):
            name = f"sim-{i}"
            sims.append(
                self.start_sim(name, self.sim_port, model=MODEL, args=["--host", host, *sim_args(self.args)])
            )
            kube.create(objects.pod(NS, name, host, ready=True))
        for child, url in zip(sims, self.sim_urls, strict=True):
            self.wait_sim(child, url)
        kubeconfig = kube.write_kubeconfig(self.workdir / "kubeconfig")
        document = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", **self.config}
        (self.workdir / "epp-config.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
        self.epp = self.start_epp(
            "epp",
            grpc_port=self.grpc_port,
            health_port=self.health_port,
            metrics_port=self.metrics_port,
            config=document,
            extra=[
                "--log-level",
                "warning",
                "--kubeconfig",
                str(kubeconfig),
                "--pool-namespace",
                NS,
                "--pool-name",
                POOL,
                *self.epp_args,
            ],
        )
        bootstrap = envoy_bootstrap(
            listen_port=self.port,
            admin_port=self.admin_port,
            extproc_port=self.grpc_port,
            body_mode="FULL_DUPLEX_STREAMED",
            response_body_mode=self.args.response_body_mode,
            response_header_mode=self.args.response_header_mode,
            fallback_endpoints=[f"{h}:{self.sim_port}" for h in self.hosts],
        )
        envoy = self.start_envoy("envoy", bootstrap, concurrency=1)
        self.wait_epp(self.epp, self.health_port)
        self.wait_envoy(envoy, self.admin_port)
        self.wait("GET /v1/models through Envoy", stack.http_ok(f"{self.url}/v1/models"))
        self.wait("the sheddable InferenceObjective to reach the EPP", self._objective_known)

    def _objective_known(self) -> bool:
        """A sheddable probe request is counted under its priority in the EPP's request metrics."""
        probe = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1}
        ).encode()
        headers = {"content-type": "application/json", **TENANT["sheddable"].headers()}
        try:
            req = urllib.request.Request(f"{self.url}/v1/chat/completions", probe, headers)
            with urllib.request.urlopen(req, timeout=5) as resp:
                resp.read()
        except OSError:
            return False
        return f'priority="{SHEDDABLE_PRIORITY}"' in self.epp_metrics()

    def epp_metrics(self) -> str:
        return _get(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def sim_stats(self, reset: bool = False) -> list[dict[str, int]]:
        out = []
        for url in self.sim_urls:
            if reset:
                req = urllib.request.Request(f"{url}/sim/stats/reset", b"", method="POST")
                with urllib.request.urlopen(req, timeout=5) as resp:
                    out.append(json.loads(resp.read()))
            else:
                out.append(json.loads(_get(f"{url}/sim/stats")))
        return out

    def wait_idle(self) -> None:
        self.wait(
            "the simulators to drain",
            lambda: all(not s["running"] and not s["waiting"] for s in self.sim_stats()),
        )

    def alive(self) -> None:
        dead = self.supervisor.exited()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited ({dead.returncode()}):\n{dead.tail(20)}")

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self.kube is not None:
                self.kube.stop()

    def __enter__(self) -> OverloadStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


# ------------------------------------------------------------------------------------- traffic


def traffic(st: OverloadStack, plan: dict[str, Any], output: Path, budget: float) -> dict[str, Any]:
    """Run the load generator with ``plan`` against the stack; its JSON result."""
    plan_path = output.with_suffix(".plan.json")
    plan_path.write_text(json.dumps({"url": st.url, "model": MODEL, **plan}))
    proc = subprocess.Popen([sys.executable, str(TRAFFIC), "--plan", str(plan_path), "--output", str(output)])
    deadline = time.monotonic() + budget
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("load generator timed out")
        time.sleep(0.2)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator exited with status {proc.returncode}")
    st.alive()
    result: dict[str, Any] = json.loads(output.read_text())
    return result


def calibrate(st: OverloadStack, args: argparse.Namespace, workdir: Path) -> float:
    """Completions/s of a closed loop with twice as many requests in flight as the fleet has slots
    (every engine full, a queue behind it), counted after a warm-up; the first sends are spread
    over one service time so that the slots do not finish in lockstep."""
    ramp = derived_service_seconds(args)
    warmup = min(ramp + 1.0, args.calibration_seconds / 2)
    concurrency = 2 * args.sims * args.max_num_seqs
    plan = {
        "mode": "closed",
        "ramp": ramp,
        "duration": args.calibration_seconds,
        "timeout": args.timeout,
        "seed": args.seed,
        "max_tokens": args.output_tokens,
        "classes": [{"name": CALIBRATION, "concurrency": concurrency}],
    }
    data = traffic(st, plan, workdir / "calibration.json", args.calibration_seconds + args.timeout + 60)
    ends = [r["end"] for r in data["requests"] if not r["error"]]
    window = args.calibration_seconds - warmup
    done = sum(1 for e in ends if warmup <= e <= args.calibration_seconds)
    errors = sum(1 for r in data["requests"] if r["error"])
    capacity = done / window
    print(
        f"calibration: closed loop of {concurrency} in flight for {args.calibration_seconds:g} s: "
        f"{capacity:.2f} completions/s after a {warmup:g} s warm-up ({errors} errors); "
        f"from the sim settings {derived_capacity(args):.2f}/s",
        flush=True,
    )
    st.wait_idle()
    return capacity


# ------------------------------------------------------------------------------------- results


@dataclass
class TenantResult:
    name: str
    priority: int
    rate: float
    sent: int = 0
    completed: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)


@dataclass
class RunResult:
    spec: RunSpec
    config_label: str
    metrics_interval: str
    tenants: list[TenantResult] = field(default_factory=list)
    peaks: list[dict[str, int]] = field(default_factory=list)
    mape: list[str] = field(default_factory=list)
    flow_control: list[str] = field(default_factory=list)
    critical_dropped_with_sheddable: Counter[str] = field(default_factory=Counter)
    critical_dropped_any_sheddable: Counter[str] = field(default_factory=Counter)
    wall: float = 0.0
    failure: str = ""

    def tenant(self, name: str) -> TenantResult | None:
        return next((t for t in self.tenants if t.name == name), None)

    @property
    def max_peak_waiting(self) -> int | None:
        return max((p["peak_waiting"] for p in self.peaks), default=None)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def rejection(rec: dict[str, Any]) -> str:
    """How a request that did not complete ended: ``<status> <dropped reason or ->`` or the error kind."""
    if rec["error"] == "http":
        return f"{rec['status']} {rec['dropped_reason'] or '-'}"
    return str(rec["error"])


def critical_dropped_with_sheddable(
    requests: Sequence[dict[str, Any]], *, served_only: bool = True
) -> Counter[str]:
    """Priority >= 0 requests that did not complete and ended while a sheddable request was in the
    system, by how they ended (see :func:`rejection`). ``served_only``: the sheddable request was
    on a model server (it was answered by one, or evicted from one), not just turned away by the
    EPP; otherwise any sheddable request sent and not yet answered counts."""

    def on_server(r: dict[str, Any]) -> bool:
        return bool(r["pod"]) or r["dropped_reason"] == "evicted" or r["error"] == "stream"

    shed = sorted(
        (r["start"], r["end"])
        for r in requests
        if TENANT[r["cls"]].priority < 0 and (not served_only or on_server(r))
    )
    out: Counter[str] = Counter()
    for r in requests:
        if TENANT[r["cls"]].priority >= 0 and r["error"] and _in_any(r["end"], shed):
            out[rejection(r)] += 1
    return out


def _in_any(t: float, intervals: Sequence[tuple[float, float]]) -> bool:
    """Whether ``t`` is inside one of ``intervals`` (sorted by start)."""
    for start, end in intervals:
        if start > t:
            return False
        if t <= end:
            return True
    return False


def metric_lines(text: str, match: Callable[[str], bool], limit: int = 60) -> list[str]:
    """Samples whose metric name passes ``match``, without comments and histogram buckets; a
    histogram's ``_count`` and ``_sum`` of one label set become one ``<name>{...} n=<count>
    mean=<sum/count>`` line. Label sets the EPP adds to every series (pool, model) are left out."""
    samples: dict[tuple[str, str], str] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if match(name) and not name.endswith("_bucket"):
            samples[(name, _short_labels(labels.rstrip("}")))] = value
    out = []
    for (name, labels), value in samples.items():
        if name.endswith("_sum") and (name[:-4] + "_count", labels) in samples:
            continue
        if name.endswith("_count") and (name[:-6] + "_sum", labels) in samples:
            count = float(value)
            total = float(samples[(name[:-6] + "_sum", labels)])
            mean = f" mean={total / count:.3g}" if count else ""
            out.append(f"{name[:-6]}{{{labels}}} n={count:g}{mean}".replace("{}", ""))
        else:
            out.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")
    return out[:limit]


_CONSTANT_LABELS = ("inference_pool", "model_name", "target_model_name")


def _short_labels(labels: str) -> str:
    """``labels`` without the ones that are the same on every series of this benchmark."""
    parts = [p for p in labels.split(",") if p and p.split("=", 1)[0] not in _CONSTANT_LABELS]
    return ",".join(parts)


def summarize(result: RunResult, data: dict[str, Any], rates: dict[str, float]) -> None:
    requests = data["requests"]
    for name in result.spec.tenants:
        t = TenantResult(name, TENANT[name].priority, rates[name])
        for r in (r for r in requests if r["cls"] == name):
            t.sent += 1
            if r["error"]:
                t.rejected[rejection(r)] += 1
            else:
                t.completed += 1
                if r["ttft"] is not None:
                    t.ttft_ms.append(r["ttft"] * 1000)
        result.tenants.append(t)
    result.critical_dropped_with_sheddable = critical_dropped_with_sheddable(requests)
    result.critical_dropped_any_sheddable = critical_dropped_with_sheddable(requests, served_only=False)
    result.wall = float(data["wall_seconds"])


def run_one(
    spec: RunSpec,
    args: argparse.Namespace,
    workdir: Path,
    capacity: list[float],
) -> RunResult:
    """One run on a fresh stack; ``capacity`` is empty until calibrated (then done on this stack,
    when its config has no flow control)."""
    if spec.flow_control:
        builtin = fc_config(args.max_num_seqs, scraped=spec.stale, fairness=spec.fairness)
        config = load_config(args.fc_config) if args.fc_config else builtin
        label = args.fc_config or f"the built-in flow-control config ({spec.fairness})"
    else:
        config = load_config(args.baseline_config)
        label = args.baseline_config or "EPP defaults"
    interval = args.metrics_interval if spec.stale else "50ms"
    epp_args = ["--refresh-metrics-interval", interval]
    if spec.stale:
        epp_args += ["--metrics-staleness-threshold", args.metrics_staleness]
    result = RunResult(spec, label, interval)
    print(f"\n== run {spec.name}: {spec.what} (EPP config: {label}; metrics every {interval})", flush=True)
    try:
        with OverloadStack(workdir / spec.name, args, config, epp_args) as st:
            if not capacity:
                capacity.append(args.capacity or calibrate(st, args, workdir / spec.name))
            rates = {name: capacity[0] * getattr(args, name) for name in spec.tenants}
            st.sim_stats(reset=True)
            plan = {
                "mode": "open",
                "duration": args.duration,
                "timeout": args.timeout,
                "seed": args.seed,
                "max_tokens": args.output_tokens,
                "classes": [
                    {"name": n, "rate": rates[n], "headers": TENANT[n].headers()} for n in spec.tenants
                ],
            }
            offered = ", ".join(f"{n} {rates[n]:.2f}/s" for n in spec.tenants)
            print(f"  offered: {offered} for {args.duration:g} s (Poisson, seed {args.seed})", flush=True)
            data = traffic(st, plan, workdir / spec.name / "traffic.json", args.duration + args.timeout + 120)
            result.peaks = st.sim_stats()
            text = st.epp_metrics()
            result.mape = metric_lines(text, lambda n: n.startswith("llm_d_epp_latency_predictor_mape"))
            # llm_d_epp_* only: the deprecated inference_extension_* twins carry the same values
            result.flow_control = metric_lines(
                text, lambda n: n.startswith("llm_d_epp_") and "flow_control" in n
            )
            summarize(result, data, rates)
    except (RuntimeError, TimeoutError, OSError) as e:
        result.failure = _failure(e, workdir / spec.name)
        print(f"  run {spec.name} failed: {result.failure}", flush=True)
    return result


def _failure(e: Exception, workdir: Path) -> str:
    """The error, with the EPP log's first error line when the EPP is what failed."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    log = workdir / "logs" / "epp.log"
    if log.exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "rror" in ln]
        if lines:
            text += f" (EPP log: {lines[0][:300]})"
    return text


def load_config(path: str | None) -> dict[str, Any]:
    """An EndpointPickerConfig file (YAML or JSON) without apiVersion and kind; None: empty."""
    if path is None:
        return {}
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(doc, dict):
        raise SystemExit(f"{path}: not a mapping")
    return {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}


# ------------------------------------------------------------------------------------ reporting


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _counted(c: Counter[str]) -> str:
    """``total (kind: n, ...)``, or ``0``."""
    if not c.total():
        return "0"
    return f"{c.total()} (" + ", ".join(f"{k}: {v}" for k, v in sorted(c.items())) + ")"


def print_run(r: RunResult) -> None:
    print(
        f"\nrun {r.spec.name}: {r.spec.what}; EPP config {r.config_label}; metrics every {r.metrics_interval}"
    )
    if r.failure:
        print(f"  FAILED: {r.failure}")
        return
    print(
        f"  {'tenant':<10} {'prio':>4} {'rate/s':>7} {'sent':>5} {'done':>5} "
        f"{'p50 ms':>7} {'p90 ms':>7}  rejected (status dropped-reason, or client error)"
    )
    for t in r.tenants:
        rejected = ", ".join(f"{k}: {v}" for k, v in sorted(t.rejected.items())) or "-"
        print(
            f"  {t.name:<10} {t.priority:>4} {t.rate:>7.2f} {t.sent:>5} {t.completed:>5} "
            f"{_ms(percentile(t.ttft_ms, 50)):>7} {_ms(percentile(t.ttft_ms, 90)):>7}  {rejected}"
        )
    peaks = ", ".join(f"sim-{i} {p['peak_waiting']}" for i, p in enumerate(r.peaks))
    running = ", ".join(f"sim-{i} {p['peak_running']}" for i, p in enumerate(r.peaks))
    print(f"  peak waiting: {peaks}; peak running: {running}")
    if len(r.tenants) > 1:
        print(
            "  priority >= 0 requests dropped while a sheddable one was on a model server: "
            f"{_counted(r.critical_dropped_with_sheddable)}; while one was anywhere (also being "
            f"turned away by the EPP): {_counted(r.critical_dropped_any_sheddable)}"
        )
    print(f"  llm_d_epp_latency_predictor_mape: {'; '.join(r.mape) if r.mape else 'n/a'}")
    if r.flow_control:
        print("  EPP flow-control metrics:")
        for line in r.flow_control:
            print(f"    {line}")
    else:
        print("  EPP flow-control metrics: none")


@dataclass
class Check:
    name: str
    value: str
    verdict: str  # PASS, FAIL or n/a


def checks(results: dict[str, RunResult], args: argparse.Namespace) -> list[Check]:
    def ok(r: RunResult | None) -> RunResult | None:
        return r if r is not None and not r.failure else None

    alone, fc, stale = ok(results.get("alone")), ok(results.get("fc")), ok(results.get("fc-stale"))
    fair = ok(results.get("fc-fair"))
    nofc = ok(results.get("no-fc"))
    out = []

    def steady_p90(r: RunResult | None) -> float | None:
        t = r.tenant("steady") if r is not None else None
        return percentile(t.ttft_ms, 90) if t is not None else None

    base, with_fc = steady_p90(alone), steady_p90(fc)
    ref = f" (no-fc {steady_p90(nofc) / base:.2f}x)" if base and steady_p90(nofc) else ""
    if base and with_fc is not None:
        ratio = with_fc / base
        out.append(
            Check(
                "steady TTFT p90 with FC <= 1.5x alone",
                f"{with_fc:.0f} ms / {base:.0f} ms = {ratio:.2f}x{ref}",
                "PASS" if ratio <= 1.5 else "FAIL",
            )
        )
    else:
        out.append(Check("steady TTFT p90 with FC <= 1.5x alone", f"needs runs alone and fc{ref}", "n/a"))
    with_fair = steady_p90(fair)
    name = "steady TTFT p90 with FC, fair share <= 2.0x alone"
    if base and with_fair is not None:
        ratio = with_fair / base
        rr = f" (round robin {with_fc / base:.2f}x)" if with_fc is not None else ""
        value = f"{with_fair:.0f} ms / {base:.0f} ms = {ratio:.2f}x{rr}"
        out.append(Check(name, value, "PASS" if ratio <= 2.0 else "FAIL"))
    else:
        out.append(Check(name, "needs runs alone and fc-fair", "n/a"))
    name = "priority >= 0 dropped while sheddable was served = 0"
    ref = f" (no-fc {_counted(nofc.critical_dropped_with_sheddable)})" if nofc else ""
    if fc is not None:
        dropped = fc.critical_dropped_with_sheddable
        verdict = "PASS" if not dropped.total() else "FAIL"
        out.append(Check(name, f"{_counted(dropped)}{ref}", verdict))
    else:
        out.append(Check(name, f"needs run fc{ref}", "n/a"))
    name = "peak waiting <= 2 per server (FC)"
    ref = f" (no-fc {nofc.max_peak_waiting})" if nofc else ""
    if fc is not None and fc.max_peak_waiting is not None:
        out.append(
            Check(name, f"max {fc.max_peak_waiting}{ref}", "PASS" if fc.max_peak_waiting <= 2 else "FAIL")
        )
    else:
        out.append(Check(name, f"needs run fc{ref}", "n/a"))
    name = f"stale metrics ({args.metrics_interval}) run still completes requests"
    if stale is not None:
        done = sum(t.completed for t in stale.tenants)
        steady = stale.tenant("steady")
        value = f"{done} completed (steady {steady.completed if steady else 0})"
        out.append(Check(name, value, "PASS" if done > 0 else "FAIL"))
    else:
        out.append(Check(name, "needs run fc-stale", "n/a"))
    return out


def print_checks(items: Sequence[Check]) -> None:
    print("\ntarget checks")
    width = max(len(c.name) for c in items)
    for c in items:
        print(f"  {c.name:<{width}}  {c.verdict:<4}  {c.value}")


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="runs, in order (default: all)")
    add("--duration", type=float, default=20.0, help="seconds of arrivals per run (default 20)")
    add("--sims", type=int, default=2, help="simulators (default 2)")
    add("--max-num-seqs", type=int, default=8, help="sim batch size (default 8)")
    add("--ttft-ms", type=float, default=200.0, help="sim --time-to-first-token (default 200)")
    add("--itl-ms", type=float, default=40.0, help="sim --inter-token-latency (default 40)")
    add(
        "--output-tokens",
        type=int,
        default=16,
        help="mean max_tokens of the requests, drawn from 1 .. 2 x this - 1 (default 16)",
    )
    add("--sim-args", default="", help="extra flags for every simulator, one shell-quoted string")
    add("--capacity", type=float, default=None, help="fleet capacity in requests/s (default: calibrate)")
    add("--calibration-seconds", type=float, default=8.0, help="closed-loop calibration length (default 8)")
    add("--steady", type=float, default=0.3, help="steady tenant's rate, fraction of capacity (default 0.3)")
    add("--flood", type=float, default=3.0, help="flooding tenant's rate, fraction of capacity (default 3.0)")
    add("--sheddable", type=float, default=0.5, help="sheddable rate, fraction of capacity (default 0.5)")
    add("--timeout", type=float, default=15.0, help="client timeout per request in seconds (default 15)")
    add(
        "--fc-config",
        default=None,
        help="EndpointPickerConfig file for the fc, fc-fair and fc-stale runs (default: the built-in ones)",
    )
    add("--baseline-config", default=None, help="EndpointPickerConfig file for alone/no-fc (default: none)")
    add(
        "--metrics-interval",
        default="15s",
        help="the EPP's --refresh-metrics-interval in the fc-stale run (default 15s; other runs 50ms)",
    )
    add(
        "--metrics-staleness",
        default="30s",
        help="the EPP's --metrics-staleness-threshold in the fc-stale run (default 30s: older scrapes "
        "still count, only their age differs)",
    )
    add(
        "--response-body-mode",
        default="FULL_DUPLEX_STREAMED",
        choices=("NONE", "STREAMED", "FULL_DUPLEX_STREAMED"),
        help="Envoy's ext_proc response body mode (default FULL_DUPLEX_STREAMED, as deploy/envoy)",
    )
    add(
        "--response-header-mode",
        default="SEND",
        choices=("SEND", "SKIP"),
        help="Envoy's ext_proc response header mode (default SEND, as the generated bootstraps)",
    )
    add("--seed", type=int, default=1, help="arrivals and prompts seed (default 1)")
    add("--keep-logs", action="store_true", help="keep the work directory (logs, configs) on success")
    args = parser.parse_args(argv)
    if min(args.sims, args.max_num_seqs, args.output_tokens) < 1 or args.duration <= 0:
        parser.error("--sims, --max-num-seqs, --output-tokens and --duration must be positive")
    if args.capacity is not None and args.capacity <= 0:
        parser.error("--capacity must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-overload-"))
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"{args.sims} sims: {shlex.join(sim_args(args))}; tenants by {LLM_D_FAIRNESS_HEADER} "
        f"(the older {FAIRNESS_HEADER} works too): "
        + ", ".join(
            f"{t.name} ({t.fairness_id}, priority {t.priority}"
            + (f" via {OBJECTIVE_HEADER}: {t.objective}" if t.objective else "")
            + ")"
            for t in TENANTS
        )
    )
    print(
        f"rates as fractions of capacity: steady {args.steady:g}, flood {args.flood:g}, "
        f"sheddable {args.sheddable:g}; client timeout {args.timeout:g} s; work dir {workdir}",
        flush=True,
    )
    if args.fc_config is None:
        for scraped in (False, True):
            doc = fc_config(args.max_num_seqs, scraped=scraped)  # fc-fair: fc with fair-share-fairness-policy
            print(
                f"built-in config of {'fc-stale' if scraped else 'fc'}:\n"
                + yaml.safe_dump(doc, sort_keys=False).rstrip()
            )
    results: dict[str, RunResult] = {}
    capacity: list[float] = [args.capacity] if args.capacity else []

    def run() -> int:
        for name in args.runs:
            spec = RUNS[name]
            if not capacity and spec.flow_control:  # calibrate without flow control
                capacity.append(calibrate_alone(args, workdir))
            results[name] = run_one(spec, args, workdir, capacity)
        return 1 if any(r.failure for r in results.values()) else 0

    def report() -> None:
        if capacity:
            print(
                f"\nfleet capacity: {capacity[0]:.2f} requests/s "
                f"(from the sim settings {derived_capacity(args):.2f})"
            )
        for r in results.values():
            print_run(r)
        print_checks(checks(results, args))

    return run_in_workdir(
        workdir,
        run,
        errors=(RuntimeError, TimeoutError, OSError, subprocess.SubprocessError),
        keep_logs=args.keep_logs,
        report=report,
    )


def calibrate_alone(args: argparse.Namespace, workdir: Path) -> float:
    """Calibration on its own stack with the baseline config (the first run has flow control)."""
    with OverloadStack(workdir / CALIBRATION, args, load_config(args.baseline_config), []) as st:
        return calibrate(st, args, workdir / CALIBRATION)


if __name__ == "__main__":
    sys.exit(main())
