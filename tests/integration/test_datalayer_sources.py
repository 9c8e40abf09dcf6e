"""Per-source ``port`` and ``interval``, ``models-data-source`` and the DCGM source through the real
``epp serve`` and ``epp sim``: a model server that exposes its metrics on a separate port (``epp sim
--metrics-port``, as Triton does) is scraped only when ``metrics-data-source`` is told that port, and
a DCGM exporter page (``epp sim --dcgm-port``) is matched to the endpoint's pod."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from epp.dev import stack
from tests.integration.harness import JSON_HEADERS, Epp, Rig, chat_body, marker

WAIT_S = 30.0
POLL_ERRORS = "llm_d_inference_scheduler_datalayer_poll_errors_total"
STATES = "llm_d_epp_datalayer_endpoints"


def _metric(epp: Epp, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(epp.metrics()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def _wait(what: str, condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _config(metrics_port: int | None) -> dict[str, object]:
    metrics_source: dict[str, object] = {"type": "metrics-data-source"}
    if metrics_port is not None:
        metrics_source["parameters"] = {"port": metrics_port, "interval": "100ms"}
    return {
        "plugins": [
            metrics_source,
            {"type": "core-metrics-extractor"},
            {"type": "models-data-source", "parameters": {"interval": "250ms"}},
            {"type": "models-data-extractor"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {"type": "single-profile-handler"},
        ],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]}
        ],
        "dataLayer": {
            "sources": [
                {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]},
                {"pluginRef": "models-data-source", "extractors": [{"pluginRef": "models-data-extractor"}]},
            ]
        },
    }


def test_metrics_on_a_separate_port_are_scraped_with_the_source_port(rig: Rig) -> None:
    metrics_port = stack.free_port()
    (sim,) = rig.start_sims(1, extra=["--metrics-port", str(metrics_port), "--lora-modules", "sql-lora"])
    ported = rig.start_epp([sim], name="ported", config=_config(metrics_port))
    plain = rig.start_epp([sim], name="plain", config=_config(None))
    # with the port the endpoint's metrics are fresh; without it its serving port has no /metrics
    _wait("fresh metrics via the source port", lambda: _metric(ported, STATES, state="fresh") == 1.0)
    _wait("failing scrapes without the port", lambda: _metric(plain, STATES, state="failed") == 1.0)
    assert _metric(plain, POLL_ERRORS, source_type="metrics-data-source") > 0
    # both poll the sim's /v1/models on the serving port without errors, and keep routing
    time.sleep(1.0)  # several models polls (every 250 ms)
    for epp in (ported, plain):
        assert _metric(epp, POLL_ERRORS, source_type="models-data-source") == 0.0
    assert _metric(ported, POLL_ERRORS, source_type="metrics-data-source") == 0.0
    envoy = rig.start_envoy(ported)
    resp = envoy.post("/v1/chat/completions", chat_body(marker()), JSON_HEADERS)
    assert resp.status == 200, resp


def test_a_wrong_models_path_counts_poll_errors(rig: Rig) -> None:
    (sim,) = rig.start_sims(1)
    config = _config(None)
    plugins = config["plugins"]
    assert isinstance(plugins, list)
    plugins[2] = {"type": "models-data-source", "parameters": {"path": "/v1/nope"}}
    epp = rig.start_epp([sim], config=config)
    _wait("models poll errors", lambda: _metric(epp, POLL_ERRORS, source_type="models-data-source") > 0)
    _wait("fresh metrics", lambda: _metric(epp, STATES, state="fresh") == 1.0)  # other sources unaffected


EXTRACT_ERRORS = "llm_d_inference_scheduler_datalayer_extract_errors_total"


def _experimental_flag() -> list[str]:
    """``--allow-experimental-plugins`` where ``epp serve`` gates alpha types (the DCGM ones) behind it."""
    out = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--help"], capture_output=True, text=True, check=False
    ).stdout
    return ["--allow-experimental-plugins"] if "--allow-experimental-plugins" in out else []


def _dcgm_config(dcgm_port: int) -> dict[str, object]:
    return {
        "plugins": [
            {"type": "dcgm-data-source", "parameters": {"port": dcgm_port, "interval": "100ms"}},
            {"type": "dcgm-extractor"},
        ],
        "dataLayer": {
            "sources": [{"pluginRef": "dcgm-data-source", "extractors": [{"pluginRef": "dcgm-extractor"}]}]
        },
    }


def test_dcgm_exporter_page_is_matched_to_the_endpoints_pod(rig: Rig) -> None:
    flag = _experimental_flag()
    port_a, port_b = stack.free_ports(2)
    # sim-0 labels its GPU with its own pod name; the other sim claims another pod's GPU
    (mine,) = rig.start_sims(1, extra=["--dcgm-port", str(port_a)])
    (other,) = rig.start_sims(1, prefix="sim", extra=["--dcgm-port", str(port_b), "--name", "someone-else"])
    good = rig.start_epp([mine], name="good", config=_dcgm_config(port_a), extra=flag)
    bad = rig.start_epp([other], name="bad", config=_dcgm_config(port_b), extra=flag)
    labels = {"source_type": "dcgm-data-source", "extractor_type": "dcgm-extractor"}
    _wait("extraction errors for a page without our pod", lambda: _metric(bad, EXTRACT_ERRORS, **labels) >= 5)
    # by now the good EPP polled as often (same interval): no poll error, no extraction error
    assert _metric(good, POLL_ERRORS, source_type="dcgm-data-source") == 0.0
    assert _metric(good, EXTRACT_ERRORS, **labels) == 0.0
    assert _metric(bad, POLL_ERRORS, source_type="dcgm-data-source") == 0.0
