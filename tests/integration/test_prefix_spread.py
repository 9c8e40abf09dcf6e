"""prefix-spread-scorer through a real Envoy: one prefix stays on one simulator while it is idle, new
system prompts spread evenly even when sent one at a time, and a concurrent burst of one prefix
spills over the pool instead of piling onto its holder."""

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
    # loadBoundMin 2: with 3 simulators the bound then binds from the 3rd concurrent request
    "plugins": [
        {"type": "prefix-spread-scorer", "parameters": {"loadBoundMin": 2}},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [{"pluginRef": "prefix-spread-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
}


def _system(kind: str) -> str:
    return f"You are the {kind} assistant of the prefix spread test. " * 40


def _body(system: str, question: str, max_tokens: int) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens}).encode()


def _served_by(envoy: Envoy, system: str, question: str, max_tokens: int = 10) -> int:
    resp = envoy.post("/v1/chat/completions", _body(system, question, max_tokens))
    assert resp.status == 200, resp
    assert resp.port is not None
    return resp.port


def test_affinity_even_spread_of_new_prompts_and_no_pile_up(rig: Rig) -> None:
    sims = rig.start_sims(SIMS, extra=SLOW)
    epp = rig.start_epp(sims, config=CONFIG)
    envoy = rig.start_envoy(epp)
    # one at a time: nothing is queued, the prefix's holder wins every time
    home = {_served_by(envoy, _system("shared"), f"question {i}", 1) for i in range(4)}
    assert len(home) == 1, f"an idle pool split one prefix over {home}"
    # new system prompts, one at a time (each finished before the next): they spread evenly
    starts = Counter(_served_by(envoy, _system(f"kind {k}"), "hello", 1) for k in range(5))
    starts.update(home)
    assert sorted(starts.values()) == [2, 2, 2], f"six prefixes were not spread evenly: {starts}"
    # all at once: the bounded load sends the surplus elsewhere
    with ThreadPoolExecutor(BURST) as pool:
        ports = list(pool.map(lambda i: _served_by(envoy, _system("shared"), f"burst {i}"), range(BURST)))
    counts = Counter(ports)
    assert len(counts) == SIMS, f"the burst did not reach every simulator: {counts}"
    assert max(counts.values()) <= 6, f"the prefix's holder took too much of the burst: {counts}"
