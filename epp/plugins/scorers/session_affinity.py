"""``session-affinity-scorer``: prefer the endpoint that served the request's session before."""

from __future__ import annotations

from epp.framework import (
    CycleState,
    Endpoint,
    LLMRequest,
    Scorer,
    register,
)
from epp.plugins.scorers._session import SessionAffinityPlugin, session_token

__all__ = ["SessionAffinityScorer", "session_token"]


@register
class SessionAffinityScorer(SessionAffinityPlugin, Scorer):
    """1.0 for the session's endpoint, 0.0 for the others (all 0.0 without a usable session)."""

    type_name = "session-affinity-scorer"
    category = "Affinity"

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        target = self.affinity.target(cycle, request, endpoints)
        if target is None:
            return [0.0] * len(endpoints)
        return [1.0 if e is target else 0.0 for e in endpoints]
