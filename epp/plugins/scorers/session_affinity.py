"""``session-affinity-scorer``: send a session's requests back to the endpoint that served it."""

from __future__ import annotations

import base64
import binascii

import structlog

from epp.framework import (
    CycleState,
    Endpoint,
    LLMRequest,
    ResponseHeaderProcessor,
    ResponseInfo,
    Scorer,
    Stability,
    register,
)
from epp.framework.wire import SESSION_TOKEN_HEADER

log = structlog.get_logger("epp.plugins.session_affinity")


def session_token(endpoint: Endpoint) -> str:
    """The token that routes a session to ``endpoint``: base64 of ``namespace/name``."""
    return base64.b64encode(endpoint.metadata.key.encode()).decode("ascii")


@register
class SessionAffinityScorer(Scorer, ResponseHeaderProcessor):
    type_name = "session-affinity-scorer"
    category = "Affinity"
    stability = Stability.ALPHA

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        token = request.headers.get(SESSION_TOKEN_HEADER, "")
        target = ""
        if token:
            try:
                target = base64.b64decode(token, validate=True).decode("utf-8", "replace")
            except (binascii.Error, ValueError) as e:
                log.debug("cannot decode session token", header=SESSION_TOKEN_HEADER, error=str(e))
        if not target:
            return [0.0] * len(endpoints)
        return [1.0 if e.metadata.key == target else 0.0 for e in endpoints]

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        if endpoint is not None:
            response.headers[SESSION_TOKEN_HEADER] = session_token(endpoint)
