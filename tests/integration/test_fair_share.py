"""``fair-share-fairness-policy`` end to end: real Envoy, the real ``epp serve``, one simulated vLLM.

A steady tenant has a request in flight when a flooding tenant sends six; flow control measures
the pool's capacity (``concurrency-detector``, 6 requests) and holds the flood at its share (3), so
a burst of two steady requests reaches the engine at once while the flood's surplus waits in the
EPP. (``round-robin-fairness-policy`` lets the flood take all but the last slot: the burst's
second request would wait for a release; tests/unit/test_fair_share_policy.py shows both.)
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from tests.integration.harness import Rig, marker
from tests.integration.test_flow_control import flow_config, metric, post, queued, slow_sim, start, wait_for

pytestmark = pytest.mark.integration


def test_a_steady_tenants_burst_is_served_ahead_of_a_flood(rig: Rig) -> None:
    sim = slow_sim(rig, itl_ms=200, tokens=20)  # each answer holds its slot about 4 s
    config = flow_config(max_concurrency=6, fairness="fair-share-fairness-policy")
    epp, envoy = start(rig, [sim], config, "FULL_DUPLEX_STREAMED")
    tag = marker()

    def at_sim(who: str) -> int:
        return sum(1 for e in sim.journal() if re.search(rf"{tag}-{who}\d", e["body"]))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(post, envoy, f"{tag}-steady0", "tenant-steady")]
        wait_for("the steady request at the engine", lambda: at_sim("steady") == 1)
        futures += [pool.submit(post, envoy, f"{tag}-flood{i}", "tenant-flood") for i in range(6)]
        wait_for("the flood's surplus queued", lambda: queued(epp) == 3)
        assert at_sim("flood") == 3  # its share of the 6 slots, not the 5 left free
        futures += [pool.submit(post, envoy, f"{tag}-steady{i}", "tenant-steady") for i in (1, 2)]
        # both go at once: the first answers take about 4 s, the flood still waits
        wait_for("the steady burst at the engine", lambda: at_sim("steady") == 3, timeout=3.0)
        assert at_sim("flood") == 3 and queued(epp) == 3
        statuses = [f.result(timeout=120).status for f in futures]
    assert statuses == [200] * 9
    assert metric(epp, "llm_d_epp_flow_control_requests_total", outcome="Dispatched") == 9
