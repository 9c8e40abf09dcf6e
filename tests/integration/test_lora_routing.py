"""LoRA at scale through Envoy: adapter residency keeps requests where their adapter is loaded.

Simulators serve twelve adapters with two GPU slots and a host cache of four each. A seeded
workload of adapters with Zipf popularity goes through a real Envoy, once with
``lora-affinity-scorer`` (which sees only adapters with a request in flight, so an idle resident
adapter looks absent) and once with the shipped ``deploy/examples/lora-at-scale.yaml``
(``lora-residency-filter`` + ``lora-load-state-scorer``, reading the residency gauges). The loads are
the simulators' own count (``vllm:lora_adapter_load_seconds_count``). A hot adapter whose holder's
queue passes ``queueThreshold`` gets a second copy, and no third with ``maxReplicas`` 2.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.dev import stack
from tests.integration.harness import Envoy, Rig, Sim, request

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "lora-at-scale.yaml"
ADAPTERS = tuple(f"ad{i}" for i in range(12))
LORA_ARGS = (
    "--lora-modules",
    *ADAPTERS,
    "--max-loras",
    "2",
    "--max-cpu-loras",
    "4",
    "--lora-load-time",
    "1",
    "--lora-host-load-time",
    "0.2",
)
EXPERIMENTAL = ["--allow-experimental-plugins"]
AFFINITY_CONFIG: dict[str, Any] = stack.one_profile_config(
    [
        {"type": "lora-affinity-scorer"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
    {
        "lora-affinity-scorer": 2,
        "queue-scorer": 1,
        "kv-cache-utilization-scorer": 1,
        "max-score-picker": None,
    },
)


def _example() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return document


def _body(adapter: str, text: str, *, max_tokens: int = 2, stream: bool = False) -> bytes:
    return json.dumps({"model": adapter, "prompt": text, "max_tokens": max_tokens, "stream": stream}).encode()


def _loads(sims: list[Sim]) -> int:
    total = 0.0
    for sim in sims:
        text = request(f"{sim.url}/metrics").body.decode()
        match = re.search(r"^vllm:lora_adapter_load_seconds_count\{[^}]*\} (\S+)$", text, re.M)
        total += float(match.group(1)) if match else 0.0
    return int(total)


def _zipf_workload(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(ADAPTERS))]
    return rng.choices(ADAPTERS, weights=weights, k=n)


def _route(envoy: Envoy, adapter: str, text: str) -> int:
    resp = envoy.post("/v1/completions", _body(adapter, text))
    assert resp.status == 200, resp
    assert resp.port is not None
    return resp.port


def _replay(envoy: Envoy, workload: list[str]) -> None:
    for i, adapter in enumerate(workload):
        _route(envoy, adapter, f"request {i}")
        if i % 10 == 9:
            time.sleep(0.06)  # a scrape interval now and then, as between bursts of real traffic


def test_zipf_adapters_load_less_with_residency_than_with_lora_affinity(rig: Rig) -> None:
    workload = _zipf_workload(100)
    sims = rig.start_sims(8, extra=LORA_ARGS)  # fresh caches for each configuration
    runs = {}
    for name, config, fleet in (("affinity", AFFINITY_CONFIG, sims[:4]), ("residency", _example(), sims[4:])):
        epp = rig.start_epp(fleet, name=f"epp-{name}", config=config, extra=EXPERIMENTAL)
        runs[name] = (rig.start_envoy(epp, name=f"envoy-{name}"), fleet)
    for envoy, _ in runs.values():
        _replay(envoy, workload)
    affinity_loads, residency_loads = (_loads(fleet) for _, fleet in runs.values())
    print(f"adapter loads: lora-affinity-scorer {affinity_loads}, residency {residency_loads}")
    assert residency_loads < affinity_loads, (residency_loads, affinity_loads)
    # every adapter needs at least one load; most of the workload must have found its adapter resident
    assert residency_loads < len(workload) // 2, (residency_loads, affinity_loads)


def test_a_resident_adapter_lands_where_it_is_resident(rig: Rig) -> None:
    sims = rig.start_sims(3, extra=LORA_ARGS)
    epp = rig.start_epp(sims, config=_example(), extra=EXPERIMENTAL)
    envoy = rig.start_envoy(epp)
    home = _route(envoy, "ad5", "first")
    time.sleep(0.2)  # the residency gauges are scraped (every 50 ms)
    for other in ("ad1", "ad2", "ad3"):  # other adapters come and go elsewhere
        _route(envoy, other, "other")
    ports = Counter(_route(envoy, "ad5", f"again {i}") for i in range(10))
    assert ports == {home: 10}, ports


def test_a_hot_adapter_spreads_up_to_max_replicas_when_its_home_queues(rig: Rig) -> None:
    slow = (*LORA_ARGS, "--max-num-seqs", "1", "--inter-token-latency", "40", "--max-tokens", "8")
    sims = rig.start_sims(3, extra=slow)
    config = _example()
    config["plugins"][0]["parameters"] = {"maxReplicas": 2, "queueThreshold": 1, "kvCacheThreshold": 0}
    epp = rig.start_epp(sims, config=config, extra=EXPERIMENTAL)
    envoy = rig.start_envoy(epp)

    def one(i: int) -> int:
        time.sleep(i * 0.05)  # a steady stream: the home's queue builds, is scraped, then a copy opens
        resp = envoy.post("/v1/completions", _body("ad0", f"burst {i}", max_tokens=8))
        assert resp.status == 200, resp
        assert resp.port is not None
        return resp.port

    with ThreadPoolExecutor(max_workers=24) as pool:
        ports = Counter(pool.map(one, range(24)))
    assert len(ports) == 2, ports  # spread to a second copy, never to a third
