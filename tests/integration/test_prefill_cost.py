"""prefill-cost-scorer through a real Envoy: one prefix stays on one simulator while it is idle, and a
concurrent burst of that prefix spreads over the pool instead of piling onto its holder."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.integration.harness import MODEL, Envoy, Rig

pytestmark = pytest.mark.integration

SIMS = 3
BURST = 12
# every request takes ~1 s at the simulator (10 output tokens x 100 ms), so the burst is all in flight
SLOW = ("--inter-token-latency", "100", "--max-tokens", "10")
CONFIG: dict[str, Any] = {
    # loadBoundMin 2: with 3 simulators the bound then binds from the 5th concurrent request
    "plugins": [
        {"type": "prefill-cost-scorer", "parameters": {"loadBoundMin": 2}},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [{"pluginRef": "prefill-cost-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
}
SYSTEM = "You are a careful assistant for the prefill cost test. " * 40


def _body(question: str) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 10}).encode()


def _served_by(envoy: Envoy, question: str) -> int:
    resp = envoy.post("/v1/chat/completions", _body(question))
    assert resp.status == 200, resp
    assert resp.port is not None
    return resp.port


def test_affinity_while_idle_and_no_pile_up_in_a_burst(rig: Rig) -> None:
    sims = rig.start_sims(SIMS, extra=SLOW)
    epp = rig.start_epp(sims, config=CONFIG)
    envoy = rig.start_envoy(epp)
    # one at a time: nothing is queued, the prefix's holder wins every time
    sequential = {_served_by(envoy, f"question {i}") for i in range(4)}
    assert len(sequential) == 1, f"an idle pool split one prefix over {sequential}"
    # all at once: the bounded load sends the surplus elsewhere
    with ThreadPoolExecutor(BURST) as pool:
        ports = list(pool.map(lambda i: _served_by(envoy, f"burst {i}"), range(BURST)))
    counts = Counter(ports)
    assert len(counts) == SIMS, f"the burst did not reach every simulator: {counts}"
    assert max(counts.values()) <= 6, f"the prefix's holder took too much of the burst: {counts}"
