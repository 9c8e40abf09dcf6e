"""Sessions from KV events: the session residency, the applier filling it from labelled stores in
the wire layouts of vLLM and SGLang, session affinity reading it, and the simulator's labels."""

from __future__ import annotations

from typing import Any

import pytest

from epp.dev.sim.block_hash import BlockHasher
from epp.dev.sim.inference import session_id_of
from epp.dev.sim.kv_events import encode_batch
from epp.dev.sim.kvcache import BlocksRemoved, BlocksStored
from epp.framework import ConfigError, CycleState, Endpoint, ProfileRunResult, SchedulingResult
from epp.framework.params import decode_params
from epp.kvcache import BlockKeyer, KVBlockIndex, SessionResidency
from epp.kvcache.sessions import MAX_LABELS
from epp.kvevents import EventApplier, decode_batch
from epp.plugins.filters.session_affinity_filter import SessionAffinityFilter
from epp.plugins.scorers.session_affinity import SessionAffinityScorer
from tests.unit.factories import endpoint, request

BS = 4


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the residency ------------------------------------------------------------------------------


def test_residency_counts_blocks_per_endpoint_and_forgets_them_with_removals_and_clears() -> None:
    r = SessionResidency()
    r.stored("a", "s1", [1, 2, 3])
    r.stored("b", "s1", [7])
    r.stored("a", "s2", [3, 4])  # block 3 shared by both sessions
    assert r.holders("s1") == {"a": 3, "b": 1}
    assert r.holders("s2") == {"a": 2}
    r.removed("a", [3])
    assert r.holders("s1") == {"a": 2, "b": 1}
    assert r.holders("s2") == {"a": 1}
    r.stored("a", "s1", [1, 2])  # a re-store is no second copy
    assert r.holders("s1")["a"] == 2
    r.forget_pod("a")
    assert r.holders("s1") == {"b": 1}
    assert r.holders("s2") == {} and len(r) == 1
    r.removed("b", [7])
    assert r.holders("s1") == {} and len(r) == 0 and r.blocks == 0


def test_residency_is_bounded_by_sessions_blocks_labels_and_time() -> None:
    clock = _Clock()
    r = SessionResidency(max_sessions=2, max_blocks=5, ttl=60.0, clock=clock)
    r.stored("a", "s1", [1, 2])
    r.stored("a", "s2", [3])
    r.stored("a", "s3", [4])  # a third session: the least recently stored one goes
    assert r.holders("s1") == {} and r.holders("s3") == {"a": 1} and len(r) == 2
    r.stored("a", "s2", [5, 6, 7, 8])  # 6 blocks > 5: s3 goes, s2 (the newest) stays
    assert r.holders("s3") == {} and r.holders("s2") == {"a": 5} and r.blocks == 5
    clock.now += 61
    assert r.holders("s2") == {}  # expired, even before a sweep
    r.stored("b", "s4", [9])  # the sweep drops s2
    assert len(r) == 1 and r.blocks == 1

    shared = SessionResidency()
    for i in range(MAX_LABELS + 2):
        shared.stored("a", f"s{i}", [42])
    assert shared.holders("s0") == {} and shared.holders("s1") == {}  # the oldest labels went
    assert shared.holders(f"s{MAX_LABELS + 1}") == {"a": 1}
    shared.removed("a", [42])
    assert len(shared) == 0 and shared.blocks == 0


def test_residency_ignores_empty_and_oversized_session_ids() -> None:
    r = SessionResidency()
    r.stored("a", "", [1])
    r.stored("a", "x" * 2000, [1])
    assert len(r) == 0 and r.labelled == 0


# --- applying events ----------------------------------------------------------------------------


def _stored(tokens: list[int], session: str | None, parent: bytes | None = None) -> BlocksStored:
    hashes, keys = BlockHasher(BS).hashes(tokens)
    return BlocksStored(list(hashes), parent, tokens, list(keys), None, None, session_id=session)


def _applier() -> tuple[EventApplier, SessionResidency]:
    sessions = SessionResidency()
    return EventApplier(KVBlockIndex(), BlockKeyer(BS), sessions), sessions


@pytest.mark.parametrize("layout", ["vllm-0.30", "vllm-0.34", "sglang-0.5.20", "sglang-0.5.22"])
def test_labelled_stores_of_each_engine_layout_fill_the_residency(layout: str) -> None:
    applier, sessions = _applier()
    first = _stored(list(range(8)), "chat-1")
    payload = encode_batch([first], block_size=BS, layout=layout)
    batch = decode_batch(payload, "sglang" if layout.startswith("sglang") else "vllm")
    assert batch.events[0].session_id == "chat-1"  # type: ignore[union-attr]
    applier.apply("a", batch)
    assert sessions.holders("chat-1") == {"a": 2}
    unlabelled = encode_batch([_stored(list(range(100, 108)), None)], block_size=BS, layout=layout)
    applier.apply("b", decode_batch(unlabelled))
    assert sessions.holders("chat-1") == {"a": 2} and len(sessions) == 1
    removed = encode_batch([BlocksRemoved([first.hashes[1]])], block_size=BS, layout=layout)
    applier.apply("a", decode_batch(removed))
    assert sessions.holders("chat-1") == {"a": 1}


def test_layouts_before_the_session_field_carry_no_label() -> None:
    applier, sessions = _applier()
    payload = encode_batch([_stored(list(range(8)), "chat-1")], block_size=BS, layout="vllm-0.29")
    applier.apply("a", decode_batch(payload))
    assert len(sessions) == 0 and len(applier.index) == 2


def test_vllm_032_map_form_decodes_the_session_id() -> None:
    """The shape msgspec gives vLLM 0.32's ``BlockStored`` (a map, defaults omitted)."""
    import msgspec

    event = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "session_id": "conv-9",
    }
    applier, sessions = _applier()
    applier.apply("a", decode_batch(msgspec.msgpack.encode([1.0, [event], None])))
    assert sessions.holders("conv-9") == {"a": 2}
    clear = msgspec.msgpack.encode([2.0, [{"type": "AllBlocksCleared"}], None])
    applier.apply("a", decode_batch(clear))
    assert sessions.holders("conv-9") == {}


def test_stores_of_another_tier_and_skipped_stores_do_not_count() -> None:
    import msgspec

    applier, sessions = _applier()
    cpu = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": BS,
        "lora_id": None,
        "medium": "CPU",
        "session_id": "s",
    }
    orphan = dict(cpu, medium="GPU", parent_block_hash=999, block_hashes=[5, 6])  # unknown parent
    applier.apply("a", decode_batch(msgspec.msgpack.encode([1.0, [cpu, orphan], None])))
    assert sessions.holders("s") == {}


# --- session affinity reading it ----------------------------------------------------------------


class _Producer:
    """Stands for a precise-prefix-cache-producer: what session affinity reads of it."""

    type_name = "precise-prefix-cache-producer"

    def __init__(self) -> None:
        self.sessions = SessionResidency()


class _Handle:
    def __init__(self, plugins: dict[str, Any]) -> None:
        self.plugins = plugins

    def plugin(self, name: str) -> Any:
        return self.plugins.get(name)

    def endpoints(self) -> list[Endpoint]:
        return []


def _build(cls: type[Any], raw: dict[str, Any], handle: Any) -> Any:
    return cls("sa", decode_params(cls.Params, raw, "plugins[0].parameters"), handle)


KV = {"strategy": "session_id", "sessionIdConfig": {"kvEventsProducerName": "pp"}}


def _pool() -> list[Endpoint]:
    return [endpoint(f"p{i}", f"10.0.0.{i}", namespace="ns") for i in range(3)]


def _commit(plugin: Any, cycle: CycleState, req: Any, picked: Endpoint) -> None:
    plugin.pre_request(cycle, req, SchedulingResult({"d": ProfileRunResult([picked])}, "d"))


def test_the_session_goes_where_its_blocks_are_and_the_binding_follows() -> None:
    producer, pool = _Producer(), _pool()
    scorer = _build(SessionAffinityScorer, KV, _Handle({"pp": producer}))
    headers = {"x-session-id": "chat-7"}
    assert scorer.score(CycleState(), request(headers=headers), pool) == [0.0, 0.0, 0.0]
    cycle, req = CycleState(), request(headers=headers)
    scorer.score(cycle, req, pool)
    _commit(scorer, cycle, req, pool[0])  # bound to p0
    assert scorer.score(CycleState(), request(headers=headers), pool) == [1.0, 0.0, 0.0]
    producer.sessions.stored("ns/p2", "chat-7", [1, 2, 3])  # the engines say: p2 holds them
    producer.sessions.stored("ns/p0", "chat-7", [9])
    cycle, req = CycleState(), request(headers=headers)
    assert scorer.score(cycle, req, pool) == [0.0, 0.0, 1.0]
    _commit(scorer, cycle, req, pool[2])
    assert scorer.affinity.store.get("chat-7") == "ns/p2"  # the binding moved with the blocks
    producer.sessions.stored("ns/p0", "chat-7", [10, 11])  # a tie keeps the binding
    assert scorer.score(CycleState(), request(headers=headers), pool) == [0.0, 0.0, 1.0]
    assert scorer.score(CycleState(), request(headers=headers), pool[:2]) == [1.0, 0.0]  # p2 absent
    other = request(headers={"x-session-id": "chat-8"})
    assert scorer.score(CycleState(), other, pool) == [0.0, 0.0, 0.0]


def test_a_replica_without_a_binding_finds_the_session_by_its_blocks_and_the_filter_pins_it() -> None:
    producer, pool = _Producer(), _pool()
    f = _build(SessionAffinityFilter, KV, _Handle({"pp": producer}))
    producer.sessions.stored("ns/p1", "agent-3", [5, 6])
    assert f.filter(CycleState(), request(headers={"x-session-id": "agent-3"}), pool) == [pool[1]]
    assert f.filter(CycleState(), request(headers={"x-session-id": "nobody"}), pool) == pool


def test_the_session_id_is_forwarded_to_the_engine_unless_the_request_carries_it() -> None:
    producer, pool = _Producer(), _pool()
    raw = {
        "strategy": "session_id",
        "sessionIdConfig": {
            "kvEventsProducerName": "pp",
            "sources": [{"attribute": "agent-identity"}],
        },
    }
    scorer = _build(SessionAffinityScorer, raw, _Handle({"pp": producer}))
    cycle, req = CycleState(), request()
    req.state["agent-identity"] = "claude-1"
    scorer.score(cycle, req, pool)
    _commit(scorer, cycle, req, pool[1])
    assert req.headers["x-session-id"] == "claude-1"
    cycle, req = CycleState(), request(headers={"x-session-id": "own"})
    req.state["agent-identity"] = "claude-1"
    scorer.score(cycle, req, pool)
    _commit(scorer, cycle, req, pool[1])
    assert req.headers["x-session-id"] == "own"

    off = {"strategy": "session_id", "sessionIdConfig": dict(raw["sessionIdConfig"], forwardSessionId=False)}
    quiet = _build(SessionAffinityScorer, off, _Handle({"pp": producer}))
    cycle, req = CycleState(), request()
    req.state["agent-identity"] = "claude-1"
    quiet.score(cycle, req, pool)
    _commit(quiet, cycle, req, pool[1])
    assert "x-session-id" not in req.headers
    plain = _build(SessionAffinityScorer, {"strategy": "session_id"}, _Handle({}))  # no KV events
    cycle, req = CycleState(), request()
    req.state["agent-identity"] = "claude-1"
    _commit(plain, cycle, req, pool[1])
    assert "x-session-id" not in req.headers


def test_the_named_producer_must_keep_a_session_residency() -> None:
    with pytest.raises(ConfigError, match="kvEventsProducerName: plugin 'pp' not found"):
        _build(SessionAffinityScorer, KV, _Handle({}))

    class _Other:
        type_name = "prefix-cache-producer"

    with pytest.raises(ConfigError, match="keeps no session residency"):
        _build(SessionAffinityScorer, KV, _Handle({"pp": _Other()}))
    bad = {"strategy": "session_id", "sessionIdConfig": {"engineSessionHeader": " "}}
    with pytest.raises(ConfigError, match="engineSessionHeader"):
        _build(SessionAffinityScorer, bad, _Handle({}))


def test_a_configuration_wires_the_precise_producer_to_session_affinity() -> None:
    from epp.config import load_config

    text = """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- {type: token-producer, parameters: {modelName: m}}
- {type: precise-prefix-cache-producer}
- type: session-affinity-scorer
  parameters: {strategy: session_id, sessionIdConfig: {kvEventsProducerName: precise-prefix-cache-producer}}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: session-affinity-scorer}, {pluginRef: max-score-picker}]
"""
    loaded = load_config(text, environ={})
    producer = loaded.plugins["precise-prefix-cache-producer"]
    scorer = loaded.plugins["session-affinity-scorer"]
    assert scorer.affinity.residency is producer.sessions
    assert producer.applier.sessions is producer.sessions


# --- the simulator ------------------------------------------------------------------------------


def test_the_simulator_reads_the_session_as_vllm_does() -> None:
    assert session_id_of({"session_id": "body"}, {"X-Session-ID": "header"}) == "body"
    assert session_id_of({"session_id": 3}, {"X-Session-ID": "header"}) == "header"
    assert session_id_of({"vllm_xargs": {"session_id": "xargs"}}, {}) == "xargs"
    assert session_id_of({"vllm_xargs": {"session_id": ""}}, {}) is None
    assert session_id_of({}, {}) is None


def test_vllms_body_field_is_a_session_source() -> None:
    producer, pool = _Producer(), _pool()
    raw = {
        "strategy": "session_id",
        "sessionIdConfig": {"kvEventsProducerName": "pp", "sources": [{"bodyField": "session_id"}]},
    }
    scorer = _build(SessionAffinityScorer, raw, _Handle({"pp": producer}))
    producer.sessions.stored("ns/p1", "in-body", [1])
    body = {"model": "m", "prompt": "p", "session_id": "in-body"}
    assert scorer.score(CycleState(), request(body), pool) == [0.0, 1.0, 0.0]
    assert scorer.score(CycleState(), request({"model": "m", "prompt": "p", "session_id": 7}), pool) == [
        0.0,
        0.0,
        0.0,
    ]
    both = {"strategy": "session_id", "sessionIdConfig": {"sources": [{"bodyField": "s", "header": "h"}]}}
    with pytest.raises(ConfigError, match="exactly one of header, attribute or bodyField"):
        _build(SessionAffinityScorer, both, _Handle({}))
