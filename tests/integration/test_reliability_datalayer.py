"""Data-layer faults through the real stack (Envoy, ``epp serve``, ``epp sim``): broken model-server
metrics must not attract traffic, and a rejected endpoints file must not empty the pool."""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.dev import stack
from tests.integration.harness import JSON_HEADERS, Epp, Rig, chat_body, marker, request

# Long requests: 50 tokens at 40 ms each (about 2 s), so that all of them overlap and the scraped
# endpoints show their load (running requests, KV-cache use) in their /metrics while requests
# are still being routed. 64 sequences at once: nothing queues inside a simulator.
LONG_SIM_ARGS = ("--inter-token-latency", "40", "--max-tokens", "50", "--max-num-seqs", "64")
HEALTHY = 3
REQUESTS = 60
STAGGER_S = 0.015  # about one scrape interval (50 ms) for every three requests
# Fair share of the broken endpoint: 1/4. Bound: 1/4 + 0.2. Even if every pick were a four-way tie
# (the scraped endpoints never looking busier than the unknown one), its count would be
# Binomial(60, 1/4): P(count >= 28) = 2e-4. Before the fix it got 76 % to 100 % of the requests.
MAX_SHARE = 1 / (HEALTHY + 1) + 0.2
FAULT_REASONS = {"error": "http_status", "hang": "timeout", "garbage": "no_metrics"}
WAIT_S = 30.0


def _samples(epp: Epp) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(epp.metrics()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _metric(epp: Epp, name: str, **labels: str) -> float | None:
    return _samples(epp).get((name, frozenset(labels.items())))


def _wait(what: str, condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("fault", sorted(FAULT_REASONS))
def test_endpoint_with_broken_metrics_gets_at_most_a_fair_share(rig: Rig, fault: str) -> None:
    healthy = rig.start_sims(HEALTHY, extra=LONG_SIM_ARGS)
    (broken,) = rig.start_sims(1, prefix="broken", extra=[*LONG_SIM_ARGS, "--metrics-fault", fault])
    epp = rig.start_epp([*healthy, broken])  # the default scheduling profile
    envoy = rig.start_envoy(epp)
    reason = FAULT_REASONS[fault]
    # the EPP sees the broken endpoint as failing (never scraped), the others as fresh
    _wait(
        "the metrics state gauge",
        lambda: (
            _metric(epp, "llm_d_epp_datalayer_endpoints", state="failed") == 1
            and _metric(epp, "llm_d_epp_datalayer_endpoints", state="fresh") == HEALTHY
        ),
    )
    assert (_metric(epp, "llm_d_epp_datalayer_scrape_failures_total", reason=reason) or 0) > 0
    assert _metric(epp, "llm_d_epp_datalayer_metrics_staleness_threshold_seconds") == 2.0

    def send(i: int) -> int | None:
        time.sleep(i * STAGGER_S)
        resp = request(envoy.url + "/v1/chat/completions", "POST", chat_body(marker()), JSON_HEADERS, 60.0)
        assert resp.status == 200, (resp.status, resp.body[:200])
        return resp.port

    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        ports = list(pool.map(send, range(REQUESTS)))
    by_port = Counter(ports)
    assert sum(by_port[s.port] for s in [*healthy, broken]) == REQUESTS
    share = by_port[broken.port] / REQUESTS
    assert share <= MAX_SHARE, f"broken endpoint got {by_port[broken.port]}/{REQUESTS}: {dict(by_port)}"
    assert all(by_port[s.port] > 0 for s in healthy)  # the load spread over the scraped ones


def _endpoints_file_doc(*entries: dict[str, object]) -> str:
    import yaml

    return yaml.safe_dump({"endpoints": list(entries)}, sort_keys=False)


def test_all_invalid_endpoints_file_keeps_the_last_good_set(rig: Rig) -> None:
    sims = rig.start_sims(2)
    epp = rig.start_epp(sims)
    envoy = rig.start_envoy(epp)
    ports = {s.port for s in sims}
    assert envoy.post("/v1/chat/completions", chat_body(marker())).port in ports

    # a file that parses but whose every entry is invalid
    stack.write_atomic(
        epp.endpoints_file,
        _endpoints_file_doc(
            {"name": "typo-0", "address": "10.0.0.300", "port": 8000},
            {"name": "typo-1", "address": "127.0.0.1", "port": "http"},
        ),
    )
    log_text = epp.child.log_path.read_text
    _wait("the invalid entries to be logged", lambda: "typo-0" in log_text() and "typo-1" in log_text())
    for _ in range(10):  # the pool still routes to the last good set
        resp = envoy.post("/v1/chat/completions", chat_body(marker()))
        assert resp.status == 200 and resp.port in ports, (resp.status, resp.body[:200])
    _wait("the rejected-file gauge", lambda: _metric(epp, "llm_d_epp_discovery_file_rejected") == 1)
    assert _metric(epp, "llm_d_epp_discovery_file_load_failures_total", reason="no_valid_entries") == 1
    assert _metric(epp, "llm_d_epp_discovery_file_invalid_entries") == 2
    # still ready (serving the last good set), with the reason as a readiness degradation
    assert stack.grpc_serving(epp.health_port, "readiness")
    log = log_text()
    assert 'endpoint \\"typo-0\\": invalid IPv4 address' in log  # each bad entry with its reason
    assert 'endpoint \\"typo-1\\": invalid port' in log
    assert "readiness degraded" in log and "discovery: endpoints file rejected" in log

    # an explicit empty list still empties the pool, and clears the failure
    stack.write_atomic(epp.endpoints_file, "endpoints: []\n")
    _wait("the pool to empty", lambda: envoy.post("/v1/chat/completions", chat_body(marker())).status == 503)
    assert _metric(epp, "llm_d_epp_discovery_file_rejected") == 0
