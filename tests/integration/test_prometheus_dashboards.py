"""The reference's dashboards and alerts, and epp's own, in a real Prometheus (Debian's package).

One run: three simulators publishing KV events (one injecting server errors), ``epp serve`` with
the precise prefix cache, its token producer and flow control, two Envoys (the bootstrap epp
generates, which sends the response headers; and one that also streams the response bodies, as a
gateway that sends the response phases does), and Prometheus scraping the EPP and the simulators
every second under the labels Kubernetes discovery would give them. Mixed traffic goes through
both Envoys (chat and completions, streamed and not, 400s, injected 5xx); then every panel query
of every current reference dashboard (see ../shared/reference/dashboards/README.md) and of
``deploy/monitoring/`` is evaluated through the HTTP API: each EPP query must return data, except
the few docs/compat.md lists as impossible here. Then the fault: every engine killed, then the
pool emptied; the reference's current alert rules and epp's own (their ``for:`` shortened in a
copy) must fire the alerts that watch for it.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.dev.stack import free_port, kv_events_labels, kv_events_sim_args
from epp.dev.stack.redis_server import RedisServer
from epp.tokenization.tokenizer import DEFAULT_TOKENIZER_DIR
from tests.integration.harness import JSON_HEADERS, MODEL, SIM_ARGS, Envoy, Rig, Sim, marker
from tests.prometheus_fixture import (
    Prometheus,
    Target,
    has_data,
    panel_queries,
    require_prometheus,
    rule_groups,
)
from tests.redis_fixture import redis_server as redis_server

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT.parent / "shared" / "reference" / "dashboards"
OWN = ROOT / "deploy" / "monitoring"
CURRENT_DASHBOARDS = (
    "llm-d__guides__recipes__observability__grafana__dashboards__llm-d-inference-gateway.json",
    "llm-d__guides__recipes__observability__grafana__dashboards__llm-d-kv-cache-index.json",
    "llm-d__guides__recipes__observability__grafana__dashboards__llm-d-failure-saturation-dashboard.json",
    "llm-d__guides__recipes__observability__grafana__dashboards__llm-d-performance-kv-cache.json",
    "llm-d__guides__recipes__observability__grafana__dashboards__llm-d-diagnostic-drilldown-dashboard.json",
    "llm-d__observability__dashboards__llm-d-dashboard.json",
)
CURRENT_RULES = (
    "llm-d__guides__recipes__observability__alerts__epp-alerting-rules.yaml",
    "llm-d__guides__recipes__observability__alerts__kv-cache-alerting-rules.yaml",
)
# EPP queries that cannot return data in a local run (docs/compat.md says why): a Go runtime
# metric, and kube-state-metrics' restart counter.
IMPOSSIBLE_HERE = ("go_goroutines", "kube_pod_container_status_restarts_total")
NAMESPACE = "llm-d"
# The scrape job of the reference guide's EPP (its "Scheduler Health" panel selects it by name).
EPP_JOB = "gaie-optimized-baseline-epp"
RANGE = "3m"  # Grafana's $__range: the whole run
VARIABLES = {
    "namespace": ".*",
    "pod": ".*",
    "model_name": ".*",
    "model": ".*",
    "pool": ".*",
    "__rate_interval": "30s",
    "__interval": "5s",
    "__range": RANGE,
    "interval": "30s",
}
PRODUCER = "precise-prefix-cache-producer"
FAIRNESS = "x-llm-d-inference-fairness-id"
# The alerts the fault must fire: errors reaching clients once the engines are dead, the data
# layer failing to scrape them, the KV-event subscribers reconnecting, the pool left empty.
ENGINES_DEAD = {
    "EPPHighErrorRatio",
    "EPPCriticalErrorRatio",
    "EPPNoReadyEndpoints",
    "EPPDataLayerPollErrors",
    "KVCacheEventsSubscriberReconnecting",
    "EppEnginesFailingRequests",
    "EppScrapeErrors",
    "EppEndpointsEjected",
}
POOL_EMPTY = {"EppPoolEmpty"}


def _config(redis_address: str) -> dict[str, Any]:
    return {
        "featureGates": ["flowControl"],
        "plugins": [
            {"name": "shared", "type": "redis-syncer", "parameters": {"address": redis_address}},
            {"type": "inflight-load-producer"},
            {"type": "active-request-scorer"},
            {"type": "session-affinity-scorer", "parameters": {"strategy": "session_id"}},
            {
                "type": "token-producer",
                "parameters": {"modelName": MODEL, "local": {"path": str(DEFAULT_TOKENIZER_DIR)}},
            },
            {
                "type": PRODUCER,
                "parameters": {
                    "tokenProcessorConfig": {"blockSizeTokens": 16},
                    "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
                },
            },
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": PRODUCER}},
            {"type": "max-score-picker"},
            {"name": "gate", "type": "concurrency-detector", "parameters": {"maxConcurrency": 3}},
            {"name": "fair", "type": "round-robin-fairness-policy"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "active-request-scorer", "weight": 1},
                    {"pluginRef": "session-affinity-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
        "flowControl": {
            "saturationDetector": {"pluginRef": "gate"},
            "defaultPriorityBand": {"fairnessPolicyRef": "fair"},
            "defaultRequestTTL": "4s",  # once the engines are dead, queued requests give up soon
        },
        "dataLayer": {
            "crossReplica": {"syncerPluginRef": "shared", "syncInterval": "200ms"},
            "discovery": {"peers": {"pluginRef": "shared"}},
        },
    }


def _system(topic: str) -> str:
    return " ".join(f"{topic} rule {i}: answer about {topic} with care and detail {i}." for i in range(30))


def _bodies(i: int) -> tuple[str, bytes]:
    """Request ``i`` of the mix: (path, body)."""
    if i % 80 == 5:  # a client error: the body names the model, not the messages
        return "/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hello"}).encode()
    kind = i % 6
    topic = ("billing", "weather", "travel")[i % 3]
    if kind == 0:
        body: dict[str, Any] = {"model": MODEL, "prompt": f"{_system(topic)} {marker()}", "max_tokens": 4}
        return "/v1/completions", json.dumps(body).encode()
    if kind == 1:
        body = {"model": MODEL, "prompt": f"{_system(topic)} {marker()}", "stream": True}
        return "/v1/completions", json.dumps(body).encode()
    messages = [{"role": "system", "content": _system(topic)}, {"role": "user", "content": marker()}]
    body = {"model": MODEL, "messages": messages}
    if kind in (3, 4):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return "/v1/chat/completions", json.dumps(body).encode()


def _traffic(envoys: list[Envoy], count: int, workers: int = 8) -> dict[int, int]:
    """``count`` requests of the mix over the Envoys in turn, ``workers`` at a time: status counts."""

    def one(i: int) -> int:
        path, body = _bodies(i)
        headers = {**JSON_HEADERS, FAIRNESS: f"tenant-{i % 3}", "x-session-id": f"session-{i // 2}"}
        return envoys[i % len(envoys)].post(path, body, headers).status

    statuses: dict[int, int] = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for status in pool.map(one, range(count)):
            statuses[status] = statuses.get(status, 0) + 1
    return statuses


def _poll(what: str, fn: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _evaluate(prom: Prometheus, files: list[Path], at: float) -> tuple[list[str], list[str], list[str], int]:
    """(EPP queries with data, EPP queries without, engine queries without, engine queries with data)."""
    ok, empty, engine_empty, engine_ok = [], [], [], 0
    for path in files:
        for title, expr in panel_queries(path, VARIABLES):
            label = f"{path.name} / {title}: {expr}"
            data = has_data(prom.query(expr, at))
            if "vllm:" in expr and "llm_d_epp" not in expr:
                engine_ok += data
                if not data:
                    engine_empty.append(label)
            elif data:
                ok.append(label)
            else:
                empty.append(label)
    return ok, empty, engine_empty, engine_ok


def _errors(prom: Prometheus, selector: str) -> float:
    return sum(float(r["value"][1]) for r in prom.query(f"sum(llm_d_epp_request_error_total{{{selector}}})"))


def test_dashboards_have_data_and_alerts_fire_on_the_fault(
    rig: Rig, redis_server: RedisServer, tmp_path: Path
) -> None:
    prometheus, promtool = require_prometheus()
    if not (REFERENCE / "README.md").is_file():
        pytest.skip(f"the reference's dashboards are not here: {REFERENCE} is absent")

    # The rules under test, their `for:` shortened, in a directory of the test's own.
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    rule_files = []
    for name in (*CURRENT_RULES, "prometheus-rule.yaml"):
        source = REFERENCE / name if name in CURRENT_RULES else OWN / name
        path = rules_dir / f"{source.stem}.rules.yaml"
        path.write_text(yaml.safe_dump({"groups": rule_groups(source, shorten_for="1s")}))
        rule_files.append(path)
    checked = subprocess.run(
        [promtool, "check", "rules", *map(str, rule_files)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    sims: list[Sim] = []
    labels: dict[str, dict[str, str]] = {}
    for i in range(3):
        pub, replay = free_port(), free_port()
        name = f"sim-{i}"
        args = [*SIM_ARGS, "--host", "127.0.0.1", "--block-size", "16", *kv_events_sim_args(pub, replay)]
        args += ["--inter-token-latency", "2", "--max-tokens", "6"]
        if i == 2:  # one engine answers some requests with a server error
            args += ["--failure-injection-rate", "0.04", "--failure-types", "server_error", "--seed", "7"]
        sims.append(rig.add_sim(name, args))
        labels[name] = kv_events_labels(pub, replay)
    for sim in sims:
        rig.stack.wait_sim(sim.child, sim.url)
    # Two replicas sharing state through Redis: one behind the generated bootstrap (response
    # headers, no body), one behind an Envoy that also streams the response bodies.
    config = _config(redis_server.address)
    extra = ["--enable-grpc-stream-metrics", "--allow-experimental-plugins=true"]
    epps = [rig.start_epp(sims, name=f"epp-{i}", config=config, labels=labels, extra=extra) for i in range(2)]
    shipped = rig.start_envoy(epps[0])
    gateway = rig.start_envoy(epps[1], name="envoy-bodies", response_body_mode="STREAMED")
    targets = [
        Target(EPP_JOB, f"127.0.0.1:{e.metrics_port}", {"namespace": NAMESPACE, "pod": f"epp-{i}"})
        for i, e in enumerate(epps)
    ]
    targets += [Target("vllm", s.address, {"namespace": NAMESPACE, "pod": s.name}) for s in sims]
    prom = Prometheus(rig.supervisor, tmp_path, prometheus).start(targets, rule_files)
    _poll("every target scraped", lambda: set(prom.targets_up().values()) == {"up"}, timeout=30)

    statuses = _traffic([shipped, gateway], 240)
    assert statuses.get(200, 0) > 200 and statuses.get(400, 0) == 3, statuses
    time.sleep(3)  # the last scrapes
    at = time.time()
    # 400s carry the model their body named; the engine's 500s count with it too
    assert _errors(prom, f'error_code="BadRequest", model_name="{MODEL}"') == 3
    assert _errors(prom, f'error_code="Internal", model_name="{MODEL}"') == statuses.get(500, 0)
    before_fault = prom.firing()

    reference = [REFERENCE / name for name in CURRENT_DASHBOARDS]
    ok, empty, engine_empty, engine_ok = _evaluate(prom, reference, at)
    missing = [q for q in empty if not any(name in q for name in IMPOSSIBLE_HERE)]
    print(f"\nreference EPP queries with data: {len(ok)}/{len(ok) + len(empty)}")
    print(f"reference engine queries with data: {engine_ok}/{engine_ok + len(engine_empty)}")
    for q in empty:
        print(f"  EPP query without data: {q}")
    assert not missing, "\n".join(missing)

    own = sorted(OWN.glob("*.json"))
    assert own, f"no dashboard in {OWN}"
    own_ok, own_empty, _, _ = _evaluate(prom, own, at)
    print(f"epp's own panel queries with data: {len(own_ok)}/{len(own_ok) + len(own_empty)}")
    assert not own_empty, "\n".join(own_empty)

    # The fault: every engine dies (Envoy answers 503: errors the EPP counts), then the pool empties.
    # (passive health may already eject the engine that injects errors, for a second at a time)
    assert not (ENGINES_DEAD | POOL_EMPTY) - {"EppEndpointsEjected"} & before_fault, before_fault
    unavailable = _errors(prom, f'pod="epp-0", error_code="ServiceUnavailable", model_name="{MODEL}"')
    for sim in sims:
        sim.child.stop()
    fired: set[str] = set()

    def fire(expected: set[str]) -> bool:
        _traffic([shipped, gateway], 8, workers=4)
        fired.update(prom.firing())
        return expected <= fired

    _poll("the alerts on dead engines", lambda: fire(ENGINES_DEAD), timeout=90)
    # the generated bootstrap's Envoy answered 503 itself: counted, with the model name
    assert _errors(prom, f'pod="epp-0", error_code="ServiceUnavailable", model_name="{MODEL}"') > unavailable
    for e in epps:
        e.set_endpoints([])
    _poll("the alerts on an empty pool", lambda: fire(POOL_EMPTY), timeout=60)
    print(f"fired on the fault: {sorted(fired)}")
