"""Prefix-aware routing keeps shared prompts on one simulator: a much higher fleet prefix-cache hit rate.

A short version of ``bench/routing.py``: the same seeded workload (``bench/_loadgen.py``: groups of
streaming chat requests sharing a long system prompt, Poisson arrivals) is sent through a real Envoy
twice, each time to freshly started simulators (cold caches): once with a random-picker-only config
(the round-robin stand-in) and once with the EPP's default profile (prefix + load scorers). The hit
rate is the simulators' own ``sum(delta vllm:prefix_cache_hits_total) / sum(delta
vllm:prefix_cache_queries_total)``. The simulators' KV caches hold about three system prompts each:
enough for the groups prefix routing sends to one simulator (also when the load scorers place them
unevenly, three on one simulator: with room for only two, evictions made the hit rate swing between
0.68 and 0.87 from run to run), too few for all six groups, which is what each simulator sees under
random routing.

Skipped while ``epp sim`` lacks ``--prefill-time-per-token`` (no prefix-cache model: the counters
stay 0). Nothing here depends on wall-clock time: only routing decisions and token counters.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from epp.dev import stack
from tests.integration.harness import MODEL, Rig, Sim, request

pytestmark = pytest.mark.integration

LOADGEN = Path(__file__).resolve().parents[2] / "bench" / "_loadgen.py"
PREFILL_FLAG = "--prefill-time-per-token"

SIMS = 3
GROUPS = 6
REQUESTS = 60
RATE = 25.0  # requests/s: light load, so the load scorers do not override prefix affinity
PROMPT_CHARS = 4000  # ~1,000 tokens = ~63 blocks of 16 per system prompt
KV_BLOCKS = 200  # ~3.2 system prompts per simulator
SIM_ARGS = (
    "--time-to-first-token",
    "0",
    PREFILL_FLAG,
    "0.01",
    "--inter-token-latency",
    "0",
    "--max-tokens",
    "2",
    "--max-num-seqs",
    "8",
    "--block-size",
    "16",
    "--kv-cache-size",
    str(KV_BLOCKS),
)
RANDOM_CONFIG: dict[str, Any] = {
    "plugins": [{"name": "picker", "type": "random-picker"}],
    "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "picker"}]}],
}


def _sim_has_prefix_cache() -> bool:
    out = subprocess.run(
        stack.python_argv("sim", "--help"), capture_output=True, text=True, timeout=60, check=False
    )
    return re.search(rf"(?<![\w-]){re.escape(PREFILL_FLAG)}(?![\w-])", out.stdout) is not None


@pytest.fixture(scope="module", autouse=True)
def _require_prefix_cache_sim() -> None:
    if not _sim_has_prefix_cache():
        pytest.skip(f"epp sim has no {PREFILL_FLAG}: the simulator's prefix-cache model has not landed")


def _counter(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", line)
        if m and m[1] == name:
            total += float(m[2])
    return total


def _cache_counters(sims: Sequence[Sim]) -> tuple[float, float]:
    hits = queries = 0.0
    for sim in sims:
        text = request(f"{sim.url}/metrics").body.decode()
        hits += _counter(text, "vllm:prefix_cache_hits_total")
        queries += _counter(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def _start_sims(rig: Rig, label: str) -> list[Sim]:
    sims = [rig.add_sim(f"{label}-sim-{i}", SIM_ARGS) for i in range(SIMS)]
    for sim in sims:
        rig.stack.wait_sim(sim.child, sim.url)
    return sims


def _run(rig: Rig, label: str, config: Mapping[str, Any] | None, tmp_path: Path) -> dict[str, Any]:
    """Fresh sims + EPP (``config``) + Envoy, the workload, then everything stopped again."""
    sims = _start_sims(rig, label)
    epp = rig.start_epp(sims, name=f"{label}-epp", config=config)
    envoy = rig.start_envoy(epp, name=f"{label}-envoy")
    h0, q0 = _cache_counters(sims)
    output = tmp_path / f"{label}.json"
    argv = [
        sys.executable,
        str(LOADGEN),
        f"--url={envoy.url}",
        f"--rate={RATE}",
        f"--requests={REQUESTS}",
        f"--groups={GROUPS}",
        f"--prompt-chars={PROMPT_CHARS}",
        "--max-tokens=2",
        f"--model={MODEL}",
        "--seed=7",
        "--timeout=30",
        f"--output={output}",
    ]
    subprocess.run(argv, check=True, timeout=60)
    h1, q1 = _cache_counters(sims)
    data: dict[str, Any] = json.loads(output.read_text())
    errors = [r["error"] for r in data["requests"] if r["error"]]
    pods: dict[int, set[str]] = {}
    for r in data["requests"]:
        pods.setdefault(r["group"], set()).add(r["pod"])
    for child in (envoy.child, epp.child, *(s.child for s in sims)):
        child.stop()
    assert q1 > q0, f"{label}: the simulators counted no prefix-cache queries"
    return {
        "hit_rate": (h1 - h0) / (q1 - q0),
        "errors": errors,
        "pods_per_group": {g: sorted(p) for g, p in sorted(pods.items())},
    }


def test_prefix_routing_beats_random_on_cache_hits(rig: Rig, tmp_path: Path) -> None:
    rand = _run(rig, "random", RANDOM_CONFIG, tmp_path)
    default = _run(rig, "default", None, tmp_path)
    summary = f"random: {rand}\ndefault: {default}"
    print(summary)
    assert not rand["errors"] and not default["errors"], summary
    assert default["hit_rate"] >= 0.7, summary
    assert default["hit_rate"] >= rand["hit_rate"] + 0.2, summary
