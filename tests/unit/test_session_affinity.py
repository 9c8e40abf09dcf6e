"""Session affinity (scorer and filter, both strategies), the session store, ``session-id-producer``."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from epp.config import load_config
from epp.framework import (
    ConfigError,
    CycleState,
    Endpoint,
    ProfileRunResult,
    ResponseInfo,
    SchedulingResult,
    Stability,
)
from epp.framework.params import decode_params
from epp.plugins.filters.session_affinity_filter import SessionAffinityFilter
from epp.plugins.producers.session_id import SessionIdProducer, SessionIdProducerParams, cookie_value
from epp.plugins.scorers._session import SessionAffinityParams, SessionStore
from epp.plugins.scorers.session_affinity import SessionAffinityScorer
from tests.unit.factories import endpoint, request

SESSION_ID = {"strategy": "session_id"}


def build(cls: type[Any], raw: dict[str, Any] | None = None) -> Any:
    return cls("sa", decode_params(cls.Params, raw, "plugins[0].parameters"))


def eps(n: int = 3) -> list[Endpoint]:
    return [endpoint(f"p{i}", f"10.0.0.{i}", namespace="ns") for i in range(n)]


def result(primary: Endpoint, prefill: Endpoint | None = None) -> SchedulingResult:
    results: dict[str, ProfileRunResult | None] = {"decode": ProfileRunResult([primary])}
    if prefill is not None:
        results["prefill"] = ProfileRunResult([prefill])
    return SchedulingResult(results, "decode")


def serve(plugin: Any, headers: dict[str, str], pool: list[Endpoint], picked: Endpoint | None = None) -> Any:
    """One request: score/filter, then the picker's choice (``picked``, default the best) committed."""
    cycle, req = CycleState(), request(headers=headers)
    if isinstance(plugin, SessionAffinityScorer):
        scores = plugin.score(cycle, req, pool)
        out: Any = scores
        best = pool[max(range(len(pool)), key=lambda i: scores[i])]
    else:
        kept = plugin.filter(cycle, req, pool)
        out = kept
        best = kept[0]
    plugin.pre_request(cycle, req, result(picked or best))
    return out


# --- encoded_endpoint_header ---------------------------------------------------------------------


def test_encoded_header_is_the_default_and_honours_a_custom_header() -> None:
    pool = eps()
    token = base64.b64encode(b"ns/p2").decode()
    scorer = build(SessionAffinityScorer, {"encodedEndpointHeaderConfig": {"header": "X-My-Token"}})
    assert scorer.score(CycleState(), request(headers={"x-my-token": token}), pool) == [0.0, 0.0, 1.0]
    assert scorer.score(CycleState(), request(headers={"x-session-token": token}), pool) == [0.0, 0.0, 0.0]
    response = ResponseInfo()
    scorer.response_header(request(), response, pool[1])
    assert response.headers == {"x-my-token": base64.b64encode(b"ns/p1").decode()}


def test_filter_pins_to_the_token_endpoint_and_passes_everything_otherwise() -> None:
    pool = eps()
    f = build(SessionAffinityFilter)
    token = base64.b64encode(b"ns/p1").decode()
    assert f.filter(CycleState(), request(headers={"x-session-token": token}), pool) == [pool[1]]
    gone = base64.b64encode(b"ns/p9").decode()
    for headers in ({}, {"x-session-token": gone}, {"x-session-token": "%%%"}):
        assert f.filter(CycleState(), request(headers=headers), pool) == pool


def test_profile_name_writes_that_profiles_endpoint_or_nothing() -> None:
    pool = eps()
    scorer = build(SessionAffinityScorer, {"profileName": "prefill"})
    req, cycle = request(), CycleState()
    scorer.pre_request(cycle, req, result(pool[0], prefill=pool[2]))
    response = ResponseInfo()
    scorer.response_header(req, response, pool[0])
    assert response.headers["x-session-token"] == base64.b64encode(b"ns/p2").decode()

    decode_only = request()
    scorer.pre_request(CycleState(), decode_only, result(pool[0]))
    untouched = ResponseInfo()
    scorer.response_header(decode_only, untouched, pool[0])
    assert untouched.headers == {}


# --- session_id ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [SessionAffinityScorer, SessionAffinityFilter])
def test_session_id_binds_on_first_request_and_sticks(cls: type[Any]) -> None:
    pool = eps()
    plugin = build(cls, SESSION_ID)
    first = serve(plugin, {"x-session-id": "s1"}, pool, picked=pool[2])
    assert first == ([0.0, 0.0, 0.0] if cls is SessionAffinityScorer else pool)  # unbound: no preference
    for _ in range(3):
        out = serve(plugin, {"x-session-id": "s1"}, pool)
        assert out == ([0.0, 0.0, 1.0] if cls is SessionAffinityScorer else [pool[2]])
    # another session is independent; a request without a session id expresses nothing
    assert serve(plugin, {"x-session-id": "s2"}, pool, picked=pool[0]) in ([0.0] * 3, pool)
    assert serve(plugin, {}, pool, picked=pool[1]) in ([0.0] * 3, pool)
    assert plugin.affinity.store.get("s2") == "ns/p0"
    assert len(plugin.affinity.store) == 2
    # nothing is written back to the client
    response = ResponseInfo()
    plugin.response_header(request(headers={"x-session-id": "s1"}), response, pool[2])
    assert response.headers == {}


def test_session_migrates_only_when_its_endpoint_is_not_a_candidate() -> None:
    pool = eps()
    scorer = build(SessionAffinityScorer, SESSION_ID)
    serve(scorer, {"x-session-id": "s"}, pool, picked=pool[0])
    # bound endpoint present but the picker chose another (other scorers outweighed it): no move
    serve(scorer, {"x-session-id": "s"}, pool, picked=pool[1])
    assert scorer.affinity.store.get("s") == "ns/p0"
    # bound endpoint absent from the candidates: the session rebinds to where it was routed
    assert serve(scorer, {"x-session-id": "s"}, pool[1:], picked=pool[2]) == [0.0, 0.0]
    assert scorer.affinity.store.get("s") == "ns/p2"


def test_sources_in_priority_order_header_then_attribute() -> None:
    pool = eps()
    params = {
        "strategy": "session_id",
        "sessionIdConfig": {
            "sources": [{"header": "X-Conversation"}, {"attribute": "SessionIDDataKey", "producer": "sid"}]
        },
    }
    scorer = build(SessionAffinityScorer, params)
    producer = SessionIdProducer("sid", SessionIdProducerParams(cookie_name="sess"))
    cycle, req = CycleState(), request(headers={"cookie": "a=1; sess=abc"})
    asyncio.run(producer.produce(cycle, req, pool))
    assert scorer.affinity.session_id(cycle, req) == "abc"
    scorer.pre_request(cycle, req, result(pool[1]))
    assert scorer.affinity.store.get("abc") == "ns/p1"
    agent = build(
        SessionAffinityScorer, {**params, "sessionIdConfig": {"sources": [{"attribute": "agent-identity"}]}}
    )
    tagged = request()
    tagged.state["agent-identity"] = "claude-1"  # a producer-agnostic attribute (no "/producer")
    assert agent.affinity.session_id(CycleState(), tagged) == "claude-1"
    both = request(headers={"cookie": "sess=abc", "x-conversation": "conv"})
    assert scorer.affinity.session_id(cycle, both) == "conv"  # the header source comes first


def test_endpoint_that_left_is_forgotten() -> None:
    pool = eps()
    for cls in (SessionAffinityScorer, SessionAffinityFilter):
        plugin = build(cls, SESSION_ID)
        serve(plugin, {"x-session-id": "a"}, pool, picked=pool[0])
        serve(plugin, {"x-session-id": "b"}, pool, picked=pool[0])
        serve(plugin, {"x-session-id": "c"}, pool, picked=pool[1])
        plugin.remove_endpoint("ns/p0")
        store = plugin.affinity.store
        assert (store.get("a"), store.get("b"), store.get("c"), len(store)) == (None, None, "ns/p1", 1)


def test_store_evicts_unused_bindings_after_ttl_at_sweep_time() -> None:
    now = [0.0]
    store = SessionStore(ttl=300.0, sweep=10.0, clock=lambda: now[0])
    store.commit("old", "ns/p0", bound_absent=False)
    now[0] = 200.0
    store.commit("young", "ns/p1", bound_absent=False)
    now[0] = 250.0
    store.commit("old", "ns/p0", bound_absent=False)  # refreshed: it is young again
    now[0] = 520.0  # "young" unused for 320 s > ttl; "old" for 270 s
    store.commit("new", "ns/p2", bound_absent=False)
    assert (store.get("young"), store.get("old"), len(store)) == (None, "ns/p0", 2)
    now[0] = 525.0  # within the sweep interval: no sweep
    store.commit("x", "ns/p2", bound_absent=False)
    now[0] = 600.0
    store.commit("x", "ns/p2", bound_absent=False)  # sweep: "old" is 350 s old, "new" 80 s
    assert (store.get("old"), store.get("new"), len(store)) == (None, "ns/p2", 2)
    store.forget_endpoint("ns/p2")
    assert len(store) == 0


def test_store_stays_bounded_under_many_one_shot_sessions() -> None:
    now = [0.0]
    store = SessionStore(ttl=5.0, sweep=1.0, clock=lambda: now[0])
    for i in range(10_000):
        now[0] = i * 0.01  # 100 new sessions a second, each seen once
        store.commit(f"s{i}", f"ns/p{i % 3}", bound_absent=False)
    assert len(store) <= 100 * (5 + 1) + 1


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        ({"strategy": "sticky"}, "plugins[0].parameters", 'strategy: must be "encoded_endpoint_header"'),
        (
            {"strategy": "session_id", "sessionIdConfig": {"evictionTtlSeconds": -1}},
            "plugins[0].parameters.sessionIdConfig.evictionTtlSeconds",
            "must be > 0",
        ),
        (
            {"sessionIdConfig": {"evictionSweepSeconds": -2}},
            "plugins[0].parameters.sessionIdConfig.evictionSweepSeconds",
            "must be > 0",
        ),
        (
            {"sessionIdConfig": {"sources": [{"header": "a", "attribute": "b"}]}},
            "plugins[0].parameters.sessionIdConfig.sources[0]",
            "exactly one of header or attribute must be set",
        ),
        (
            {"sessionIdConfig": {"sources": [{}]}},
            "plugins[0].parameters.sessionIdConfig.sources[0]",
            "exactly one of header or attribute must be set",
        ),
        (
            {"encodedEndpointHeaderConfig": {"name": "x"}},
            "plugins[0].parameters.encodedEndpointHeaderConfig.name",
            "",
        ),
    ],
)
def test_bad_parameters_name_the_field(raw: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_params(SessionAffinityParams, raw, "plugins[0].parameters")
    assert str(info.value).startswith(field)
    assert reason in str(info.value)


def test_defaults_and_stability() -> None:
    params = decode_params(SessionAffinityParams, None, "p")
    cfg = params.session_id_config
    assert (params.strategy, cfg.eviction_ttl_seconds, cfg.eviction_sweep_seconds) == (
        "encoded_endpoint_header",
        300.0,
        10.0,
    )
    assert [s.header for s in cfg.sources] == ["x-session-id"]
    zero = decode_params(SessionAffinityParams, {"sessionIdConfig": {"evictionTtlSeconds": 0}}, "p")
    assert zero.session_id_config.eviction_ttl_seconds == 300.0  # 0 means the default
    assert SessionAffinityScorer.stability is Stability.ALPHA
    assert SessionAffinityFilter.stability is Stability.ALPHA


def test_loaded_config_wires_the_filter_as_pre_request_and_state_holder() -> None:
    text = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: session-affinity-filter, parameters: {strategy: session_id}}
- {type: max-score-picker}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: session-affinity-filter}, {pluginRef: max-score-picker}]}
"""
    cfg = load_config(text, environ={})
    plugin = cfg.plugins["session-affinity-filter"]
    assert plugin in cfg.pre_request


# --- session-id-producer -------------------------------------------------------------------------


def test_session_id_producer_reads_header_or_cookie() -> None:
    by_header = SessionIdProducer("p", decode_params(SessionIdProducerParams, {"headerName": "X-Sid"}, "p"))
    cycle = CycleState()
    req = request(headers={"x-sid": " abc "})
    asyncio.run(by_header.produce(cycle, req, []))
    assert req.state == {"SessionIDDataKey/p": "abc"}
    blank = request(headers={"x-sid": "  "})
    asyncio.run(by_header.produce(CycleState(), blank, []))
    assert blank.state == {}
    assert cookie_value("a=1; llm-d-session=xyz; b", "llm-d-session") == "xyz"
    assert cookie_value("a=1", "llm-d-session") == ""


@pytest.mark.parametrize(
    ("raw", "field"), [({}, "headerName"), ({"headerName": "a", "cookieName": "b"}, "cookieName")]
)
def test_session_id_producer_needs_exactly_one_source(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_params(SessionIdProducerParams, raw, "plugins[0].parameters")
    assert info.value.field == f"plugins[0].parameters.{field}"
    assert "exactly one of headerName or cookieName" in info.value.reason
