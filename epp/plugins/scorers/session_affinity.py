"""``session-affinity-scorer``: prefer the endpoint that served the request's session before."""

from __future__ import annotations

from epp.framework import (
    CycleState,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    ResponseHeaderProcessor,
    ResponseInfo,
    SchedulingResult,
    Scorer,
    Stability,
    register,
)
from epp.plugins.scorers._session import SessionAffinity, SessionAffinityParams, session_token

__all__ = ["SessionAffinityScorer", "session_token"]


@register
class SessionAffinityScorer(Scorer, PreRequest, ResponseHeaderProcessor):
    """1.0 for the session's endpoint, 0.0 for the others (all 0.0 without a usable session)."""

    type_name = "session-affinity-scorer"
    category = "Affinity"
    stability = Stability.ALPHA
    Params = SessionAffinityParams
    params: SessionAffinityParams

    def __init__(self, name: str, params: SessionAffinityParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.affinity = SessionAffinity(f"session-affinity:{self.typed_name}", params)

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        target = self.affinity.target(cycle, request, endpoints)
        if target is None:
            return [0.0] * len(endpoints)
        return [1.0 if e is target else 0.0 for e in endpoints]

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        self.affinity.pre_request(cycle, request, result)

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        self.affinity.response_header(request, response, endpoint)

    def remove_endpoint(self, key: str) -> None:
        self.affinity.remove_endpoint(key)
