"""``session-affinity-filter``: pin a session's requests to the endpoint that served it before."""

from __future__ import annotations

from epp.framework import (
    CycleState,
    Endpoint,
    Filter,
    Handle,
    LLMRequest,
    PreRequest,
    ResponseHeaderProcessor,
    ResponseInfo,
    SchedulingResult,
    Stability,
    register,
)
from epp.plugins.scorers._session import SessionAffinity, SessionAffinityParams

__all__ = ["SessionAffinityFilter"]


@register
class SessionAffinityFilter(Filter, PreRequest, ResponseHeaderProcessor):
    """Only the session's endpoint when it is a candidate, otherwise every candidate (never empty)."""

    type_name = "session-affinity-filter"
    stability = Stability.ALPHA
    Params = SessionAffinityParams
    params: SessionAffinityParams

    def __init__(self, name: str, params: SessionAffinityParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.affinity = SessionAffinity(f"session-affinity:{self.typed_name}", params)

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        target = self.affinity.target(cycle, request, endpoints)
        return [target] if target is not None else list(endpoints)

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        self.affinity.pre_request(cycle, request, result)

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        self.affinity.response_header(request, response, endpoint)

    def remove_endpoint(self, key: str) -> None:
        self.affinity.remove_endpoint(key)
