"""Sessions through KV events, end to end: real Envoy, ``epp serve`` and ``epp sim`` engines that
label the blocks they store with the request's ``session_id`` (as vLLM >= 0.30 does). A session's
next turn, its history re-rendered so that its prompt now shares a prefix with another engine's
cache, still lands on the engine holding the session's blocks, even though this EPP never bound
the session (its first turn went to the engine directly); the session loses that pull once its
engine drops its cache; a session id taken from an agent's own header is forwarded to the engine
(in ``x-session-id``, which vLLM reads), a client's own ``x-session-id`` is left as it is."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from epp.dev.stack import free_port, kv_events_labels, kv_events_sim_args
from epp.tokenization import DEFAULT_TOKENIZER_DIR
from tests.integration.harness import JSON_HEADERS, MODEL, SIM_ARGS, Envoy, Epp, Rig, Sim, request

PRODUCER = "precise-prefix-cache-producer"
SESSION_HEADER = "x-session-id"


REPLAYS = "llm_d_epp_kv_cache_events_replays_total"
CONFIG: dict[str, Any] = {
    "plugins": [
        {
            "type": "token-producer",
            "parameters": {"modelName": MODEL, "local": {"path": str(DEFAULT_TOKENIZER_DIR)}},
        },
        {"type": "agent-identity"},
        {
            "type": PRODUCER,
            "parameters": {
                "tokenProcessorConfig": {"blockSizeTokens": 16},
                "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
            },
        },
        {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": PRODUCER}},
        {
            "type": "session-affinity-scorer",
            "parameters": {
                "strategy": "session_id",
                "sessionIdConfig": {
                    "sources": [{"header": SESSION_HEADER}, {"attribute": "agent-identity"}],
                    "kvEventsProducerName": PRODUCER,
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


def _value(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and labels in series:
            total += float(value)
    return total


class Fleet:
    """Three sims publishing KV events (each labels its stores with the request's session), the EPP
    with ``CONFIG`` and Envoy; ready once every subscription's first replay is complete."""

    def __init__(self, rig: Rig) -> None:
        self.sims: list[Sim] = []
        labels: dict[str, dict[str, str]] = {}
        for i in range(3):
            pub, replay = free_port(), free_port()
            name = f"sim-{i}"
            args = [*SIM_ARGS, "--host", "127.0.0.1", "--block-size", "16", *kv_events_sim_args(pub, replay)]
            self.sims.append(rig.add_sim(name, args))
            labels[name] = kv_events_labels(pub, replay)
        for sim in self.sims:
            rig.stack.wait_sim(sim.child, sim.url)
        self.epp: Epp = rig.start_epp(
            self.sims, config=CONFIG, labels=labels, extra=["--allow-experimental-plugins=true"]
        )
        self.envoy: Envoy = rig.start_envoy(self.epp)
        _poll("every KV-event subscription's first replay", lambda: self.metric(REPLAYS, "complete") >= 3)

    def metric(self, name: str, labels: str = "") -> float:
        return _value(self.epp.metrics(), name, labels)

    def admissions(self) -> float:
        return self.metric("llm_d_epp_kv_cache_index_admissions_total")


def _poll(what: str, fn: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _system(topic: str, sentences: int = 40) -> str:
    return " ".join(f"{topic} rule {i}: help with {topic}, detail number {i}." for i in range(sentences))


def _chat(system: str, turns: list[str]) -> bytes:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


def _seed(fleet: Fleet, sim: Sim, body: bytes, headers: Mapping[str, str] | None = None) -> None:
    """Serve ``body`` on ``sim`` directly (the EPP never sees it) and wait until the EPP indexed
    the blocks it reported."""
    before = fleet.admissions()
    resp = request(f"{sim.url}/v1/chat/completions", "POST", body, {**JSON_HEADERS, **(headers or {})})
    assert resp.status == 200, resp
    _poll(f"the blocks {sim.name} stored", lambda: fleet.admissions() > before)


def _routed(fleet: Fleet, body: bytes, headers: Mapping[str, str] | None = None) -> Sim:
    resp = fleet.envoy.post("/v1/chat/completions", body, headers)
    assert resp.status == 200, resp
    return next(s for s in fleet.sims if s.port == resp.port)


def test_a_sessions_next_turn_finds_its_engine_though_its_history_was_re_rendered(rig: Rig) -> None:
    fleet = Fleet(rig)
    sim0, sim1, sim2 = fleet.sims
    shared = _system("general")
    _seed(fleet, sim2, _chat(shared, ["warm-up"]))  # sim-2 holds the shared system prompt

    # Turn 1 of two sessions, served by their engines directly: this EPP never bound them.
    _seed(fleet, sim1, _chat("Today is Monday. " + _system("travel"), ["plan a trip"]), {SESSION_HEADER: "A"})
    _seed(fleet, sim0, _chat("Today is Monday. " + _system("cooking"), ["a recipe"]), {SESSION_HEADER: "B"})

    # Turn 2, re-rendered by the client under the shared system prompt: the prefix index points
    # at sim-2, the engines' session labels at the session's own engine.
    turn2 = _chat(shared, ["plan a trip", "Where to?", "Rome"])
    assert _routed(fleet, turn2).name == "sim-2"  # no session: the prefix wins
    assert _routed(fleet, turn2, {SESSION_HEADER: "unknown"}).name == "sim-2"
    assert _routed(fleet, turn2, {SESSION_HEADER: "A"}).name == "sim-1"
    b_turn2 = _chat(shared, ["a recipe", "Which?", "soup"])
    assert _routed(fleet, b_turn2, {SESSION_HEADER: "B"}).name == "sim-0"

    # sim-0 drops its cache: session B's blocks are gone, and so is its pull (this EPP's binding of
    # B to sim-0 stays, so B keeps its engine only through the binding, not more strongly).
    evictions = fleet.metric("llm_d_epp_kv_cache_index_evictions_total")
    assert request(f"{sim0.url}/reset_prefix_cache", "POST").status == 200
    _poll("sim-0's cache reset", lambda: fleet.metric("llm_d_epp_kv_cache_index_evictions_total") > evictions)
    _seed(fleet, sim1, _chat("Today is Monday. " + _system("cooking"), ["a recipe"]), {SESSION_HEADER: "B"})
    b_turn3 = _chat(shared, ["a recipe", "Which?", "stew"])
    assert _routed(fleet, b_turn3, {SESSION_HEADER: "B"}).name == "sim-1"


def test_an_agent_session_is_forwarded_to_the_engine_and_labels_its_blocks(rig: Rig) -> None:
    fleet = Fleet(rig)
    for sim in fleet.sims:
        request(f"{sim.url}/debug/requests", "DELETE")
    agent = {"x-claude-code-session-id": "cc-42"}
    served = _routed(fleet, _chat("Today is Monday. " + _system("coding"), ["fix the bug"]), agent)
    [entry] = served.journal()
    assert entry["headers"][SESSION_HEADER] == "cc-42"  # the EPP forwarded the agent's session
    assert "session_id" not in json.loads(entry["body"])
    client_own = _routed(fleet, _chat(_system("other"), ["hi"]), {**agent, SESSION_HEADER: "mine"})
    assert client_own.journal()[-1]["headers"][SESSION_HEADER] == "mine"  # never overwritten
