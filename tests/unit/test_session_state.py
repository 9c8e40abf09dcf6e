"""``session-state-producer``: turns taken, duration and last seen per agent session, bounded."""

from __future__ import annotations

import asyncio

import pytest

from epp.framework import CycleState, ProfileRunResult, SchedulingResult
from epp.framework.attributes import AGENT_IDENTITY_KEY, SessionState
from epp.framework.params import decode_params
from epp.plugins.producers.session_state import SessionStateParams, SessionStateProducer
from tests.unit.factories import completions, config_error, endpoints


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _producer(**kw: float) -> tuple[SessionStateProducer, _Clock]:
    p = SessionStateProducer("ss", SessionStateParams(**kw))  # type: ignore[arg-type]
    clock = _Clock()
    p.clock = p.monotonic = clock
    return p, clock


def _turn(p: SessionStateProducer, session: str | None, *, routed: bool = True) -> SessionState | None:
    req = completions()
    if session is not None:
        req.state[AGENT_IDENTITY_KEY] = session
    eps = endpoints(1)
    asyncio.run(p.produce(CycleState(), req, eps))
    result = SchedulingResult({"d": ProfileRunResult(eps if routed else [])}, "d")
    p.pre_request(CycleState(), req, result)
    state = req.state.get(p.key)
    return state if isinstance(state, SessionState) else None


def test_turns_duration_and_last_seen() -> None:
    p, clock = _producer()
    assert _turn(p, "a") == SessionState(0, 0.0, 1000.0)
    clock.t = 1010.0
    assert _turn(p, "a") == SessionState(1, 10.0, 1000.0)
    clock.t = 1025.0
    assert _turn(p, "a", routed=False) == SessionState(2, 25.0, 1010.0)  # not routed: no turn counted
    clock.t = 1030.0
    assert _turn(p, "a") == SessionState(2, 30.0, 1025.0)
    assert _turn(p, "b") == SessionState(0, 0.0, 1030.0)
    assert _turn(p, None) is None and len(p) == 2  # no agent identity: nothing


def test_idle_sessions_expire_and_memory_is_bounded() -> None:
    p, clock = _producer(eviction_ttl_seconds=60, eviction_sweep_seconds=10)
    _turn(p, "old")
    clock.t += 30
    _turn(p, "young")
    clock.t += 45  # old idle 75 s, young 45 s
    _turn(p, "other")
    assert len(p) == 2
    assert _turn(p, "old") == SessionState(0, 0.0, clock.t)  # starts over
    small, _ = _producer(max_sessions=3)
    for i in range(10):
        _turn(small, f"s{i}")
    assert len(small) == 3
    assert _turn(small, "s9") is not None and small_turns(small, "s9") == 2


def small_turns(p: SessionStateProducer, session: str) -> int:
    state = _turn(p, session)
    assert state is not None
    return state.turns_taken


def test_parameters_are_checked() -> None:
    assert decode_params(SessionStateParams, {"evictionTtlSeconds": 0}, "p").eviction_ttl_seconds == 0
    with pytest.raises(Exception, match="evictionSweepSeconds"):
        decode_params(SessionStateParams, {"evictionSweepSeconds": 0}, "p")
    err = config_error("plugins:\n- type: session-state-producer\n  parameters: {maxSessions: 0}\n")
    assert err.field.endswith("maxSessions")
