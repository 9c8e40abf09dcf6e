"""``agent-identity`` (alpha): the agent session a request belongs to, from its session headers.

The first non-empty header among ``additionalSessionHeaders`` and then the built-in ones (Claude
Code, OpenCode, Codex, Codex's older spelling) becomes the ``agent-identity`` request attribute;
the director then uses it as the fairness id when no fairness header was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import Handle, LLMRequest, RequestHeaderProcessor, Stability, register
from epp.framework.attributes import AGENT_IDENTITY_KEY

__all__ = ["DEFAULT_SESSION_HEADERS", "AgentIdentity", "AgentIdentityParams"]

DEFAULT_SESSION_HEADERS = (
    "x-claude-code-session-id",  # Claude Code
    "x-session-affinity",  # OpenCode
    "session-id",  # Codex
    "session_id",  # Codex before 0.131
)


@dataclass(slots=True, frozen=True)
class AgentIdentityParams:
    """Header names checked before the built-in ones, in order (matched case-insensitively)."""

    additional_session_headers: tuple[str, ...] = ()


@register
class AgentIdentity(RequestHeaderProcessor):
    type_name = "agent-identity"
    stability = Stability.ALPHA
    Params = AgentIdentityParams
    params: AgentIdentityParams

    def __init__(
        self, name: str, params: AgentIdentityParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else AgentIdentityParams()
        super().__init__(name, params, handle)
        merged = [h.lower() for h in params.additional_session_headers if h]
        merged.extend(h for h in DEFAULT_SESSION_HEADERS if h not in merged)
        self.headers: tuple[str, ...] = tuple(merged)

    def request_header(self, request: LLMRequest) -> None:
        headers = request.headers
        for name in self.headers:
            value = headers.get(name)
            if value:
                request.state[AGENT_IDENTITY_KEY] = value
                return
