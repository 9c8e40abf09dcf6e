"""Three EPP replicas with a ``redis-syncer`` over a real ``redis-server`` share the metrics scrape:
each engine (``epp sim``, which counts the ``/metrics`` scrapes it serves) sees about one EPP's
scrape rate, every replica keeps every endpoint fresh, and a killed replica's engines are
scraped again within the bound (the owner's grace, 3 sync intervals + 2 scrapes, plus a scrape)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.dev.stack.redis_server import RedisServer
from tests.integration.harness import Epp, Rig, Sim, request
from tests.redis_fixture import redis_server as redis_server

pytestmark = pytest.mark.integration

SYNC_S = 0.05
SCRAPE_S = 0.1
RATE = 1 / SCRAPE_S  # one EPP's scrapes per second per engine
BOUND_S = 3 * SYNC_S + 2 * SCRAPE_S + SCRAPE_S


def _config(address: str) -> dict[str, Any]:
    return {
        "plugins": [
            {"name": "shared", "type": "redis-syncer", "parameters": {"address": address, "stateTTL": "1s"}},
            {"type": "metrics-data-source", "parameters": {"interval": f"{int(SCRAPE_S * 1000)}ms"}},
            {"type": "core-metrics-extractor"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]}
        ],
        "dataLayer": {
            "sources": [
                {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}
            ],
            "crossReplica": {"syncerPluginRef": "shared", "syncInterval": f"{int(SYNC_S * 1000)}ms"},
            "discovery": {"peers": {"pluginRef": "shared"}},
        },
    }


def _sample(epp: Epp, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(epp.metrics()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def _wait(what: str, condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def _scrapes(sims: list[Sim]) -> list[int]:
    return [request(f"{s.url}/sim/stats").json()["metrics_scrapes"] for s in sims]


def _rates(sims: list[Sim], seconds: float) -> list[float]:
    before = _scrapes(sims)
    time.sleep(seconds)
    return [(a - b) / seconds for a, b in zip(_scrapes(sims), before, strict=True)]


def test_three_replicas_share_the_scrape_and_take_over_a_dead_replicas_engines(
    rig: Rig, redis_server: RedisServer
) -> None:
    sims = rig.start_sims(4)
    epps = [rig.start_epp(sims, name=f"epp-{i}", config=_config(redis_server.address)) for i in range(3)]
    _wait(
        "every replica sees its 2 peers",
        lambda: all(_sample(e, "llm_d_epp_cross_replica_peers") == 2 for e in epps),
    )
    fresh = "llm_d_epp_datalayer_endpoints"
    _wait(
        "every endpoint fresh on every replica",
        lambda: all(_sample(e, fresh, state="fresh") == 4 for e in epps),
    )

    # Shared: each engine sees about one EPP's rate (three unshared replicas: about 3x).
    rates = _rates(sims, 2.0)
    assert all(0.5 * RATE <= r <= 1.5 * RATE for r in rates), rates
    assert all(_sample(e, fresh, state="fresh") == 4 for e in epps)

    # A replica dies: its engines are scraped again within the bound, by the survivors.
    epps[0].child.kill()
    survivors = epps[1:]
    killed_at = time.monotonic()
    before = _scrapes(sims)
    _wait(
        "every engine scraped after the kill",
        lambda: all(a > b for a, b in zip(_scrapes(sims), before, strict=True)),
        timeout=5.0,
    )
    assert time.monotonic() - killed_at < BOUND_S + 1.0  # the bound, plus polling on a busy machine
    assert all(_sample(e, fresh, state="fresh") == 4 for e in survivors)
    # once the dead replica expired (stateTTL), one survivor owns each engine: one EPP's rate again
    _wait(
        "the survivors see one peer",
        lambda: all(_sample(e, "llm_d_epp_cross_replica_peers") == 1 for e in survivors),
    )
    rates = _rates(sims, 2.0)
    assert all(0.5 * RATE <= r <= 1.5 * RATE for r in rates), rates
    assert all(_sample(e, fresh, state="fresh") == 4 for e in survivors)
