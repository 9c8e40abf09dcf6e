"""LoRA residency read from a real vLLM: one engine of the suite (``--enable-lora``, the tiny adapter
``tiny-lora``, one adapter slot) beside one ``epp sim`` serving the same adapter and another, behind
the EPP (``lora-residency-filter`` + ``lora-load-state-scorer``) and Envoy.

vLLM 0.32 exports no residency gauges (``vllm:lora_adapter_loaded`` and the slot counts are absent):
only ``vllm:lora_requests_info``, whose newest series names the adapters of running and waiting
requests and the slots (``max_lora``). The plugins' fallback reads an adapter with a running request
as GPU-resident. The simulator reports residency with the gauges. On the simulator ``tiny-lora``
sits in the host cache (a tier above vLLM's free slot), so a request for it goes to the simulator
unless the EPP reads vLLM's running adapter: while vLLM runs a long ``tiny-lora`` request, the
filter keeps ``tiny-lora`` on vLLM; ``other-lora`` (GPU-resident on the simulator only) stays there.

The engine is the first of the suite's pool (each of its engines serves ``tiny-lora`` in one slot),
or the first of ``EPP_ENGINE_URLS`` (with ``EPP_ENGINE_LORA`` naming the adapter it serves)."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import pytest

from epp.dev import stack
from tests.engines.harness import (
    Engine,
    Front,
    Pool,
    samples,
    start_front,
    total,
    wait_for,
)
from tests.integration.harness import SIM_ARGS, Rig

OTHER = "other-lora"
INFO = "vllm:lora_requests_info"
DECISIONS = "llm_d_router_endpoint_picker_lora_residency_filter_decisions_total"
SCRAPE = 0.1  # the EPP's metrics refresh interval here, in seconds


@pytest.fixture(scope="module")
def one_engine(pool: Pool) -> Pool:
    """The first engine of the suite's pool (or of ``EPP_ENGINE_URLS``): one more engine of our own
    would cost a start-up and 3 GB for nothing this test needs alone."""
    if not pool.lora:
        pytest.skip("EPP_ENGINE_LORA names no adapter served by the engines of EPP_ENGINE_URLS")
    return Pool(pool.engines[:1], pool.model, pool.block_size, lora=pool.lora)


def _config() -> dict[str, Any]:
    return stack.one_profile_config(
        [
            {"type": "lora-residency-filter", "parameters": {"maxReplicas": 2}},
            {"type": "lora-load-state-scorer"},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "max-score-picker"},
        ],
        {
            "lora-residency-filter": None,
            "lora-load-state-scorer": 2,
            "queue-scorer": 1,
            "kv-cache-utilization-scorer": 1,
            "max-score-picker": None,
        },
    )


def _newest_info(engine: Engine) -> dict[str, str]:
    """The labels of the newest ``vllm:lora_requests_info`` series (its value: the time it was set);
    empty before vLLM has set one."""
    found = samples(engine.metrics(), INFO)
    if not found:  # vLLM sets the series at its first stats after a request
        return {}
    labels, _ = max(found, key=lambda s: s[1])
    out: dict[str, str] = {}
    for part in labels.strip("{}").split('",'):
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip('"')
    return out


def _decisions(front: Front, outcome: str) -> float:
    return total(front.epp_metrics(), DECISIONS, f'outcome="{outcome}"')


def _settle() -> None:
    """Let the EPP refresh every endpoint's metrics after a change seen on the engines."""
    time.sleep(5 * SCRAPE)


class _LongRequest:
    """A streamed completion on ``engine`` that runs until closed (vLLM aborts it on disconnect)."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._conn = http.client.HTTPConnection(engine.host, engine.port, timeout=60)
        body = {
            "model": model,
            "prompt": "a b c",
            "max_tokens": 3500,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        self._conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        self._resp = self._conn.getresponse()
        assert self._resp.status == 200, self._resp.read()[:300]
        assert self._resp.readline()  # the first chunk: it runs

    def running(self) -> bool:
        """Whether it has not finished (its last chunk not yet sent)."""
        line = self._resp.readline()
        return bool(line) and b"[DONE]" not in line

    def close(self) -> None:
        self._conn.close()


def test_adapter_running_on_vllm_keeps_its_requests_there(one_engine: Pool, rig: Rig) -> None:
    vllm = one_engine.engines[0]
    adapter = one_engine.lora
    port = stack.free_port()
    sim_args = [
        *SIM_ARGS,
        "--host",
        "127.0.0.1",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "4",
        "--lora-modules",
        adapter,
        OTHER,
    ]
    child = rig.stack.start_sim("sim-0", port, model=one_engine.model, args=sim_args)
    rig.stack.wait_sim(child, f"http://127.0.0.1:{port}")
    sim = Engine("sim-0", port)
    pool = Pool([vllm, sim], one_engine.model, one_engine.block_size, lora=adapter)
    front = start_front(
        rig,
        pool,
        _config(),
        epp_extra=["--allow-experimental-plugins=true", f"--refresh-metrics-interval={int(SCRAPE * 1000)}ms"],
    )

    # The simulator: other-lora in its only GPU slot (idle), tiny-lora evicted to its host cache.
    sim.complete("x", adapter)
    sim.complete("x", OTHER)
    loaded = [lb for lb, v in samples(sim.metrics(), "vllm:lora_adapter_loaded") if v > 0]
    assert any(f'adapter_name="{adapter}"' in lb and 'level="cpu"' in lb for lb in loaded), loaded
    assert any(f'adapter_name="{OTHER}"' in lb and 'level="gpu"' in lb for lb in loaded), loaded
    _settle()

    long = _LongRequest(vllm, adapter)
    try:
        wait_for(
            f"vLLM to report {adapter} running",
            lambda: _newest_info(vllm).get("running_lora_adapters") == adapter,
            timeout=30,
        )
        # What vLLM 0.32 exports: the request info series with its slots, no residency gauges.
        info = _newest_info(vllm)
        assert set(info) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}, info
        assert info["max_lora"] == "1"
        assert not samples(vllm.metrics(), "vllm:lora_adapter_loaded")
        _settle()
        sticky = _decisions(front, "sticky")
        served = [front.complete("y", model=adapter)[0].name for _ in range(4)]
        still = long.running()
        other = front.complete("z", model=OTHER)[0].name
    finally:
        long.close()
    assert still, "the long request ended before the routed ones: the check saw no running adapter"
    assert served == [vllm.name] * 4, served
    assert other == sim.name
    # Every one of them kept on its only home: vLLM (its running adapter) or the simulator (gauges).
    assert _decisions(front, "sticky") - sticky == 5
