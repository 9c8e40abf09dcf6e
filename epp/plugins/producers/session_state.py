"""``session-state-producer`` (alpha): a session's history for session-aware plugins.

Sessions are the ``agent-identity`` request attribute. Before scheduling the producer publishes
``SessionState`` (turns taken, duration, last seen) as the request attribute
``SessionStateDataKey/<name>`` and marks the session seen; a turn counts in ``pre_request`` once a
target was picked (one per request, whatever the profiles). Memory is bounded: idle sessions
expire after ``evictionTtlSeconds`` (swept at most every ``evictionSweepSeconds``, on the request
path, no task), and beyond ``maxSessions`` the least recently seen one is dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from epp.framework import (
    CycleState,
    DataProducer,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    Stability,
    register,
)
from epp.framework.attributes import AGENT_IDENTITY_KEY, SESSION_STATE_KEY, SessionState
from epp.framework.endpoint_attributes import data_key
from epp.framework.results import SchedulingResult

__all__ = ["SessionStateParams", "SessionStateProducer"]


@dataclass(slots=True, frozen=True)
class SessionStateParams:
    eviction_ttl_seconds: float = 3600.0  # 0: never expire (maxSessions still bounds memory)
    eviction_sweep_seconds: float = 300.0
    max_sessions: int = 100_000  # epp extension

    def validate(self) -> str | None:
        if self.eviction_ttl_seconds < 0:
            return f"evictionTtlSeconds: must be non-negative, got {self.eviction_ttl_seconds:g}"
        if self.eviction_sweep_seconds <= 0:
            return f"evictionSweepSeconds: must be greater than 0, got {self.eviction_sweep_seconds:g}"
        if self.max_sessions <= 0:
            return f"maxSessions: must be greater than 0, got {self.max_sessions}"
        return None


class _Session:
    __slots__ = ("first", "last", "last_mono", "turns")

    def __init__(self, now: float, mono: float) -> None:
        self.first = self.last = now
        self.last_mono = mono
        self.turns = 0


@register
class SessionStateProducer(DataProducer, PreRequest):
    type_name = "session-state-producer"
    stability = Stability.ALPHA
    Params = SessionStateParams
    params: SessionStateParams
    produces = frozenset({SESSION_STATE_KEY})

    def __init__(
        self, name: str, params: SessionStateParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else SessionStateParams()
        super().__init__(name, params, handle)
        self.key = data_key(SESSION_STATE_KEY, name)
        self._turn_key = f"{self.type_name}/{name}/turn"
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently seen first
        self._ttl = params.eviction_ttl_seconds
        self._sweep_every = params.eviction_sweep_seconds
        self._max = params.max_sessions
        self._next_sweep = 0.0
        self.clock = time.time
        self.monotonic = time.monotonic

    def __len__(self) -> int:
        return len(self._sessions)

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        ident = request.state.get(AGENT_IDENTITY_KEY)
        if not isinstance(ident, str) or not ident:
            return
        now, mono = self.clock(), self.monotonic()
        if self._ttl > 0 and mono >= self._next_sweep:
            self._sweep(mono)
        sessions = self._sessions
        s = sessions.get(ident)
        if s is None:
            s = sessions[ident] = _Session(now, mono)
            state = SessionState(0, 0.0, now)
            if len(sessions) > self._max:
                sessions.popitem(last=False)
        else:
            state = SessionState(s.turns, max(0.0, now - s.first), s.last)
            s.last, s.last_mono = now, mono
            sessions.move_to_end(ident)
        request.state[self.key] = state
        request.state[self._turn_key] = ident

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        ident = request.state.pop(self._turn_key, None)
        primary = result.primary
        if ident is None or primary is None or not primary.target_endpoints:
            return
        s = self._sessions.get(ident)
        if s is not None:
            s.turns += 1

    def _sweep(self, mono: float) -> None:
        self._next_sweep = mono + self._sweep_every
        cutoff = mono - self._ttl
        sessions = self._sessions
        while sessions:  # least recently seen first: stop at the first live one
            ident, s = next(iter(sessions.items()))
            if s.last_mono > cutoff:
                break
            del sessions[ident]
