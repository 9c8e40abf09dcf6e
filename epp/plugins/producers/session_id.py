"""``session-id-producer``: publish a request's session identifier (a header or a cookie) for affinity.

Request attributes live in ``LLMRequest.state`` under ``"<attribute>/<producer name>"``, or the bare
attribute name for a producer-agnostic one (see ``request_attribute_key``); this producer writes
``SessionIDDataKey/<its name>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.framework import CycleState, DataProducer, Endpoint, Handle, LLMRequest, register
from epp.framework.endpoint_attributes import data_key
from epp.framework.params import OMIT_UNSET

__all__ = [
    "SESSION_ID_DATA_KEY",
    "SessionIdProducer",
    "SessionIdProducerParams",
    "cookie_value",
    "request_attribute_key",
]

SESSION_ID_DATA_KEY = "SessionIDDataKey"
_COOKIE_HEADER = "cookie"


def request_attribute_key(attribute: str, producer: str) -> str:
    """The ``LLMRequest.state`` key of a request attribute: ``attribute/producer``, or ``attribute``
    alone when it is producer-agnostic (``producer`` empty, e.g. ``agent-identity``)."""
    return data_key(attribute, producer) if producer else attribute


def cookie_value(header: str, name: str) -> str:
    """The value of cookie ``name`` in a ``Cookie`` header (``a=1; b=2``), ``""`` when absent."""
    if not header or not name:
        return ""
    for pair in header.split(";"):
        key, sep, value = pair.strip().partition("=")
        if sep and key == name:
            return value
    return ""


@dataclass(slots=True, frozen=True)
class SessionIdProducerParams:
    """Exactly one of ``headerName`` (case-insensitive) or ``cookieName``."""

    header_name: str = field(default="", metadata=OMIT_UNSET)  # one of the two
    cookie_name: str = field(default="", metadata=OMIT_UNSET)

    def validate(self) -> str | None:
        header, cookie = self.header_name.strip(), self.cookie_name.strip()
        if not header and not cookie:
            return (
                "headerName: session-id-producer requires exactly one of headerName or cookieName to be set"
            )
        if header and cookie:
            return (
                "cookieName: session-id-producer requires exactly one of headerName or cookieName "
                "to be set, not both"
            )
        return None


@register
class SessionIdProducer(DataProducer):
    type_name = "session-id-producer"
    Params = SessionIdProducerParams
    params: SessionIdProducerParams
    produces = frozenset({SESSION_ID_DATA_KEY})

    def __init__(self, name: str, params: SessionIdProducerParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.key = request_attribute_key(SESSION_ID_DATA_KEY, name)
        self._header = params.header_name.strip().lower()
        self._cookie = params.cookie_name.strip()

    def session_id(self, request: LLMRequest) -> str:
        """The request's session identifier, ``""`` when it carries none."""
        if self._header:
            return request.headers.get(self._header, "").strip()
        return cookie_value(request.headers.get(_COOKIE_HEADER, ""), self._cookie).strip()

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        sid = self.session_id(request)
        if sid:
            request.state[self.key] = sid
