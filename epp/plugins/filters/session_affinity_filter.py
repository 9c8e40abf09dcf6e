"""``session-affinity-filter``: pin a session's requests to the endpoint that served it before."""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, Filter, LLMRequest, register
from epp.plugins.scorers._session import SessionAffinityPlugin

__all__ = ["SessionAffinityFilter"]


@register
class SessionAffinityFilter(SessionAffinityPlugin, Filter):
    """Only the session's endpoint when it is a candidate, otherwise every candidate (never empty)."""

    type_name = "session-affinity-filter"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        target = self.affinity.target(cycle, request, endpoints)
        return [target] if target is not None else list(endpoints)
