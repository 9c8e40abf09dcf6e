"""Sessions through a real vLLM's KV events: vLLM (0.30 and later) labels every block it stores
with the request's ``session_id`` (here the ``x-session-id`` header the EPP forwards from an
agent's own session header). One real engine and one ``epp sim`` (the same model name, block size
and token ids) behind the EPP and Envoy; the EPP restarts, so what it knows of the session comes
from vLLM's replayed events alone, and the session's next turn, re-rendered so that its prompt
shares a prefix with the simulator's cache, still lands on vLLM.

The engine is the first of the suite's pool (or of ``EPP_ENGINE_URLS``)."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import pytest

from epp.dev import stack
from tests.engines.harness import (
    UPSTREAM_HEADER,
    Engine,
    Front,
    Pool,
    start_front,
    total,
    wait_for,
)
from tests.integration.harness import SIM_ARGS, Rig

PRECISE = "precise-prefix-cache-producer"
AGENT_HEADER = "x-claude-code-session-id"
REPLAYS = "llm_d_epp_kv_cache_events_replays_total"
ADMISSIONS = "llm_d_epp_kv_cache_index_admissions_total"


@pytest.fixture(scope="module")
def one_engine(pool: Pool) -> Pool:
    """The first engine of the suite's pool (or of ``EPP_ENGINE_URLS``): one more engine of our own
    would cost a start-up and 3 GB for nothing this test needs alone."""
    return Pool(pool.engines[:1], pool.model, pool.block_size, lora=pool.lora)


def _config(pool: Pool) -> dict[str, Any]:
    return {
        "apiVersion": "llm-d.ai/v1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {
                "type": "token-producer",
                "parameters": {"modelName": pool.model, "vllm": {"url": pool.engines[0].url}},
            },
            {"type": "agent-identity"},
            {
                "type": PRECISE,
                "parameters": {
                    "tokenProcessorConfig": {"blockSizeTokens": pool.block_size},
                    "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
                },
            },
            {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": PRECISE}},
            {
                "type": "session-affinity-scorer",
                "parameters": {
                    "strategy": "session_id",
                    "sessionIdConfig": {
                        "sources": [{"header": "x-session-id"}, {"attribute": "agent-identity"}],
                        "kvEventsProducerName": PRECISE,
                    },
                },
            },
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 1},
                    {"pluginRef": "session-affinity-scorer", "weight": 2},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 2000) for _ in range(n)]


def _post(url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def _completion(model: str, ids: list[int]) -> dict[str, Any]:
    return {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}


def _direct(engine: Engine, model: str, ids: list[int]) -> None:
    """Served on ``engine`` directly (no session: its blocks carry no label)."""
    status, _, body = _post(f"{engine.url}/v1/completions", _completion(model, ids), {})
    assert status == 200, (engine.name, status, body[:300])


def _through(front: Front, ids: list[int], session: str) -> Engine:
    """Sent through Envoy as the agent session ``session``: the engine that served it."""
    url = front.envoy.url + "/v1/completions"
    status, headers, data = _post(url, _completion(front.pool.model, ids), {AGENT_HEADER: session})
    assert status == 200, (status, data[:300])
    return front.pool.by_address(headers[UPSTREAM_HEADER])


def _replayed(front: Front, engines: int) -> None:
    wait_for(
        "every subscription's first replay",
        lambda: total(front.epp_metrics(), REPLAYS, 'outcome="complete"') >= engines,
        timeout=60,
    )


def _indexed(front: Front, before: float) -> None:
    wait_for("the EPP to index the new blocks", lambda: total(front.epp_metrics(), ADMISSIONS) > before)


def test_a_session_labelled_by_vllm_finds_its_engine_after_an_epp_restart(one_engine: Pool, rig: Rig) -> None:
    vllm = one_engine.engines[0]
    bs = one_engine.block_size
    port, pub, replay = stack.free_ports(3)
    sim_args = [*SIM_ARGS, "--host", "127.0.0.1", "--block-size", str(bs), "--max-model-len", "4096"]
    child = rig.stack.start_sim(
        "sim-0", port, model=one_engine.model, args=[*sim_args, *stack.kv_events_sim_args(pub, replay)]
    )
    rig.stack.wait_sim(child, f"http://127.0.0.1:{port}")
    sim = Engine("sim-0", port, kv_pub=pub, kv_replay=replay)
    pool = Pool([vllm, sim], one_engine.model, bs)
    front = start_front(rig, pool, _config(pool), epp_extra=["--allow-experimental-plugins=true"])
    _replayed(front, 2)

    history = _ids(1, 4 * bs)  # the session's first turn, its prefix served on vLLM beforehand
    shared = _ids(2, 4 * bs)  # a prefix the simulator holds
    before = total(front.epp_metrics(), ADMISSIONS)
    _direct(vllm, pool.model, history)
    _direct(sim, pool.model, shared)
    _indexed(front, before)

    # Turn 1 through the EPP: the prefix sends it to vLLM; the EPP forwards the agent's session in
    # x-session-id, so vLLM labels the blocks it stores beyond the prefix with it.
    assert _through(front, history + _ids(3, 3 * bs), "agent-7").name == vllm.name

    # A new EPP: no binding; what it knows of agent-7 comes from vLLM's replayed, labelled events.
    front.restart_epp()
    _replayed(front, 2)
    turn2 = shared + _ids(4, 2 * bs)  # re-rendered: now it shares the simulator's prefix
    assert _through(front, turn2, "agent-8").name == "sim-0"  # an unlabelled session: the prefix
    assert _through(front, turn2, "agent-7").name == vllm.name
