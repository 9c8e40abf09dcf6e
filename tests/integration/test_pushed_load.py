"""Pushed load through the real stack: ``epp sim --load-publish-port`` publishes SGLang's LoadStat,
``epp serve`` (a ``zmq-metrics-data-source``) receives it, and Envoy routes. While an engine pushes
it is not scraped; when its publisher stops (the engine keeps serving) the scrape takes over
within ``fallbackAfter`` plus a scrape, and no request fails."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp.dev import stack
from tests.integration.harness import JSON_HEADERS, Epp, Rig, Sim, chat_body, marker, request

WAIT_S = 20.0


def _scrapes(sim: Sim) -> int:
    resp = request(f"{sim.url}/sim/stats")
    assert resp.status == 200, resp
    count: int = resp.json()["metrics_scrapes"]
    return count


def _fresh(epp: Epp) -> float:
    for family in text_string_to_metric_families(epp.metrics()):
        for s in family.samples:
            if s.name == "llm_d_epp_datalayer_endpoints" and s.labels == {"state": "fresh"}:
                return float(s.value)
    return 0.0


def _wait(what: str, condition: Callable[[], bool], timeout: float = WAIT_S) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def _config(push_port: int) -> dict[str, object]:
    return {
        "plugins": [
            {"type": "metrics-data-source", "parameters": {"interval": "100ms"}},
            {"type": "core-metrics-extractor"},
            {"type": "zmq-metrics-data-source", "parameters": {"port": push_port, "fallbackAfter": "300ms"}},
            {"type": "zmq-state-extractor"},
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
                {
                    "pluginRef": "zmq-metrics-data-source",
                    "extractors": [{"pluginRef": "zmq-state-extractor"}],
                },
            ]
        },
    }


def _point_at_hosts(epp: Epp, sims: list[Sim]) -> None:
    """The harness writes 127.0.0.1 endpoints: rewrite the file with each sim's own address."""
    document = stack.endpoints_document([s.port for s in sims], names=[s.name for s in sims])
    for entry, sim in zip(document["endpoints"], sims, strict=True):
        entry["address"] = sim.host
    stack.write_atomic(epp.endpoints_file, yaml.safe_dump(document, sort_keys=False))


def _quiet(sims: list[Sim], seconds: float) -> list[int]:
    """The scrapes each sim served during ``seconds``."""
    before = [_scrapes(s) for s in sims]
    time.sleep(seconds)
    return [_scrapes(s) - b for s, b in zip(sims, before, strict=True)]


def test_pushed_load_replaces_the_scrape_and_a_dead_publisher_falls_back(rig: Rig) -> None:
    push_port = stack.free_port()
    # one address per engine (pods): every publisher binds the same port, as SGLang's would
    sims = rig.start_sims(
        2,
        hosts=["127.0.0.2", "127.0.0.3"],
        extra=["--load-publish-port", str(push_port), "--load-publish-interval-ms", "20"],
    )
    epp = rig.start_epp(sims, config=_config(push_port))
    _point_at_hosts(epp, sims)
    envoy = rig.start_envoy(epp)
    _wait("both endpoints fresh", lambda: _fresh(epp) == 2.0)
    # pushing: the 100 ms scrape is skipped (10 scrapes a second each without the pushes)
    _wait("the scrapes to stop while pushes arrive", lambda: max(_quiet(sims, 0.5)) == 0)
    assert max(_quiet(sims, 1.0)) == 0

    stopped = request(f"{sims[0].url}/sim/load-stat/stop", "POST")
    assert stopped.status == 200, stopped
    with ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(
                lambda _: envoy.post("/v1/chat/completions", chat_body(marker()), JSON_HEADERS), range(40)
            )
        )
    assert [r.status for r in responses] == [200] * 40, [r for r in responses if r.status != 200][:1]
    # the silent engine is scraped again (about 10 a second), the pushing one still is not
    during = _quiet(sims, 1.0)
    assert during[0] >= 4 and during[1] == 0, during
    assert _fresh(epp) == 2.0  # the fallback kept its metrics fresh
    assert {r.port for r in responses} == {s.port for s in sims}  # both kept serving
