"""Precise prefix-cache routing end to end: real Envoy, ``epp serve`` and ``epp sim`` engines that
publish vLLM KV events. Requests follow the blocks the engines report (blocks put there by requests
that never went through the EPP), an engine's cache reset moves them away, and a lost KV-event
batch is recovered by replay; in a pool of engines publishing the layouts of vLLM 0.20, vLLM 0.34
and SGLang 0.5.22, LoRA and salted requests follow the blocks announced for them."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from epp.dev.stack import free_port, kv_events_labels, kv_events_sim_args
from epp.tokenization import DEFAULT_TOKENIZER_DIR
from tests.integration.harness import JSON_HEADERS, MODEL, SIM_ARGS, Envoy, Epp, Rig, Sim, request
from tests.llm_d_corpus import needs_corpus, project_config

REFERENCE_SAMPLE = project_config("precise-prefix")
PRODUCER = "precise-prefix-cache-producer"
REPLAYS = "llm_d_epp_kv_cache_events_replays_total"
CONFIG = {
    "plugins": [
        {
            "type": "token-producer",
            "parameters": {"modelName": MODEL, "local": {"path": str(DEFAULT_TOKENIZER_DIR)}},
        },
        {
            "type": PRODUCER,
            "parameters": {
                "tokenProcessorConfig": {"blockSizeTokens": 16},
                "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
            },
        },
        {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": PRODUCER}},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [{"pluginRef": "prefix-cache-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
}


def _value(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _poll(what: str, fn: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _system(topic: str, sentences: int = 40) -> str:
    """A long system prompt, distinct per topic from its first words on."""
    return " ".join(
        f"{topic} rule {i}: answer about {topic} with care and detail number {i}." for i in range(sentences)
    )


def _chat(system: str, question: str, model: str = MODEL, salt: str = "") -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 1}
    if salt:
        body["cache_salt"] = salt
    return json.dumps(body).encode()


class Fleet:
    def __init__(
        self,
        rig: Rig,
        count: int = 3,
        config: Callable[[list[Sim]], dict[str, Any]] | None = None,
        extra: Sequence[Sequence[str]] = (),
    ) -> None:
        """``count`` sims publishing KV events (sim ``i`` with the flags ``extra[i]`` too), the EPP
        with ``config(sims)`` (default ``CONFIG``) and Envoy."""
        self.sims: list[Sim] = []
        self.labels: dict[str, dict[str, str]] = {}
        for i in range(count):
            pub, replay = free_port(), free_port()
            name = f"sim-{i}"
            args = [*SIM_ARGS, "--host", "127.0.0.1", "--block-size", "16", *kv_events_sim_args(pub, replay)]
            args += extra[i] if i < len(extra) else ()
            self.sims.append(rig.add_sim(name, args))
            self.labels[name] = kv_events_labels(pub, replay)
        for sim in self.sims:
            rig.stack.wait_sim(sim.child, sim.url)
        document = config(self.sims) if config is not None else CONFIG
        self.epp: Epp = rig.start_epp(self.sims, config=document, labels=self.labels)
        self.envoy: Envoy = rig.start_envoy(self.epp)
        # Each subscription asks for a replay from 0 when it connects: once all are complete, the
        # EPP's index holds everything the engines published.
        _poll(
            "every KV-event subscription's first replay",
            lambda: self.metric(REPLAYS, 'outcome="complete"') >= count,
        )

    def metric(self, name: str, labels: str = "") -> float:
        return _value(self.epp.metrics(), name, labels)

    def admissions(self) -> float:
        return self.metric("llm_d_epp_kv_cache_index_admissions_total")

    def seed(self, sim: Sim, body: bytes) -> None:
        """Serve ``body`` on ``sim`` directly (the EPP never sees it) and wait until the EPP indexed
        the blocks it reported."""
        before = self.admissions()
        resp = request(f"{sim.url}/v1/chat/completions", "POST", body, JSON_HEADERS)
        assert resp.status == 200, resp
        _poll(f"the blocks {sim.name} stored", lambda: self.admissions() > before)

    def routed(self, bodies: Sequence[bytes]) -> list[str]:
        """The sim each request went to through Envoy."""
        names = []
        for body in bodies:
            resp = self.envoy.post("/v1/chat/completions", body, JSON_HEADERS)
            assert resp.status == 200, resp
            port = resp.port
            names.append(next(s.name for s in self.sims if s.port == port))
        return names


def test_requests_follow_the_blocks_the_engines_report_even_after_a_cache_reset(rig: Rig) -> None:
    fleet = Fleet(rig)
    sim0, sim1, sim2 = fleet.sims
    billing, weather = _system("billing"), _system("weather")
    fleet.seed(sim2, _chat(billing, "seed"))
    fleet.seed(sim0, _chat(weather, "seed"))
    assert fleet.routed([_chat(billing, f"question {i}") for i in range(4)]) == ["sim-2"] * 4
    assert fleet.routed([_chat(weather, f"question {i}") for i in range(4)]) == ["sim-0"] * 4

    # sim-2 drops its whole cache: its AllBlocksCleared must take it out of the EPP's index. sim-1
    # then holds only the first half of the billing prompt: a shorter match than sim-2 had.
    evictions = fleet.metric("llm_d_epp_kv_cache_index_evictions_total")
    assert request(f"{sim2.url}/reset_prefix_cache", "POST").status == 200
    _poll("sim-2's cache reset", lambda: fleet.metric("llm_d_epp_kv_cache_index_evictions_total") > evictions)
    fleet.seed(sim1, _chat(_system("billing", sentences=20), "seed"))
    assert fleet.routed([_chat(billing, f"after reset {i}") for i in range(4)]) == ["sim-1"] * 4


def test_a_lost_kv_event_batch_is_recovered_by_replay(rig: Rig) -> None:
    fleet = Fleet(rig)
    sim0 = fleet.sims[0]
    replays = fleet.metric(REPLAYS, 'outcome="complete"')
    # sim-0 skips the next batch on PUB (it stays in its replay buffer): its blocks for the legal
    # prompt reach the EPP only through replay, once the next batch shows the gap.
    assert request(f"{sim0.url}/sim/kv-events/drop?count=1", "POST").status == 200
    legal = _system("legal")
    resp = request(f"{sim0.url}/v1/chat/completions", "POST", _chat(legal, "seed"), JSON_HEADERS)
    assert resp.status == 200
    fleet.seed(sim0, _chat(_system("travel"), "seed"))  # the next batch: the gap, then replay
    _poll("the replayed batch", lambda: fleet.metric(REPLAYS, 'outcome="complete"') > replays)
    assert fleet.metric("llm_d_epp_kv_cache_events_endpoint_clears_total") == 0  # recovered, not dropped
    assert fleet.routed([_chat(legal, f"question {i}") for i in range(4)]) == ["sim-0"] * 4


def _reference_sample(sims: list[Sim]) -> dict[str, Any]:
    """The reference's precise-prefix sample as shipped, its deployment values (model name, render
    URL) pointed at the simulators."""
    config: dict[str, Any] = yaml.safe_load(REFERENCE_SAMPLE.read_text())
    [tokenizer] = [p for p in config["plugins"] if p["type"] == "token-producer"]
    tokenizer["parameters"]["modelName"] = MODEL
    tokenizer["parameters"]["vllm"]["url"] = sims[0].url
    return config


@needs_corpus
def test_the_reference_precise_sample_runs_with_render_tokenization(rig: Rig) -> None:
    """token-producer rendering through vLLM's render endpoint, endpoint-notification-source, the
    reference's scorers and weights: requests still follow the reported blocks."""
    fleet = Fleet(rig, config=_reference_sample)
    sim2 = fleet.sims[2]
    support = _system("support")
    fleet.seed(sim2, _chat(support, "seed"))
    renders = fleet.metric("llm_d_epp_token_producer_render_cache_total", 'result="miss"')
    assert fleet.routed([_chat(support, f"question {i}") for i in range(4)]) == ["sim-2"] * 4
    # each request (a new question) was tokenized by the render endpoint, none failed
    assert fleet.metric("llm_d_epp_token_producer_render_cache_total", 'result="miss"') == renders + 4
    assert fleet.metric("llm_d_epp_token_producer_render_failures_total") == 0


def test_lora_and_salted_requests_follow_their_blocks_in_a_pool_of_vllm_and_sglang_engines(rig: Rig) -> None:
    """sim-0 publishes as vLLM 0.20 (array events, ``group_idx`` without a kind), sim-1 as SGLang
    0.5.22 (maps with ``cache_salt`` and ``lora_name``), sim-2 as vLLM 0.34 (maps, the adapter
    first in every block's ``extra_keys``); the EPP's ``engineType`` is the default ``vllm``."""
    lora = ["--lora-modules", "ad", "--max-loras", "2"]
    layouts = ("vllm-0.20", "sglang-0.5.22", "vllm-0.34")
    fleet = Fleet(rig, extra=[[*lora, "--kv-events-layout", layout] for layout in layouts])
    sim0, sim1, sim2 = fleet.sims
    # one prompt: the adapter's blocks on sim-2, the base model's on sim-0
    shared = _system("shared")
    fleet.seed(sim2, _chat(shared, "seed", model="ad"))
    fleet.seed(sim0, _chat(shared, "seed"))
    assert fleet.routed([_chat(shared, f"question {i}", model="ad") for i in range(3)]) == ["sim-2"] * 3
    assert fleet.routed([_chat(shared, f"question {i}") for i in range(3)]) == ["sim-0"] * 3
    # one prompt: tenant-a's salted blocks on the SGLang engine, the unsalted ones on sim-0
    tenant = _system("tenant")
    fleet.seed(sim1, _chat(tenant, "seed", salt="tenant-a"))
    fleet.seed(sim0, _chat(tenant, "seed"))
    assert fleet.routed([_chat(tenant, f"question {i}", salt="tenant-a") for i in range(3)]) == ["sim-1"] * 3
    assert fleet.routed([_chat(tenant, f"question {i}") for i in range(3)]) == ["sim-0"] * 3
    # an SGLang adapter request: its blocks, named by lora_name, are sim-1's
    other = _system("adapter")
    fleet.seed(sim1, _chat(other, "seed", model="ad"))
    fleet.seed(sim2, _chat(other, "seed"))
    assert fleet.routed([_chat(other, f"question {i}", model="ad") for i in range(3)]) == ["sim-1"] * 3
    assert fleet.metric("llm_d_epp_kv_cache_events_endpoint_clears_total") == 0  # no batch failed to decode


def _sglang_engine_type(sims: list[Sim]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(json.dumps(CONFIG))
    config["plugins"][1]["parameters"]["kvEventsConfig"] = {"engineType": "sglang"}
    return config


def test_older_layouts_route_alike_under_engine_type_sglang(rig: Rig) -> None:
    """vLLM 0.10 (arrays without a medium), SGLang 0.5.18 (arrays, the salt in a metadata map) and
    vLLM 0.27 (maps with ``locality``) behind an EPP configured ``engineType: sglang``."""
    layouts = ("vllm-0.10", "sglang-0.5.18", "vllm-0.27")
    fleet = Fleet(
        rig, config=_sglang_engine_type, extra=[["--kv-events-layout", layout] for layout in layouts]
    )
    prompts = [_system(topic) for topic in ("alpha", "beta", "gamma")]
    for sim, prompt in zip(fleet.sims, prompts, strict=True):
        fleet.seed(sim, _chat(prompt, "seed", salt="t1" if sim.name == "sim-1" else ""))
    assert fleet.routed([_chat(prompts[0], f"q {i}") for i in range(2)]) == ["sim-0"] * 2
    assert fleet.routed([_chat(prompts[1], f"q {i}", salt="t1") for i in range(2)]) == ["sim-1"] * 2
    assert fleet.routed([_chat(prompts[2], f"q {i}") for i in range(2)]) == ["sim-2"] * 2
    assert fleet.metric("llm_d_epp_kv_cache_events_endpoint_clears_total") == 0
