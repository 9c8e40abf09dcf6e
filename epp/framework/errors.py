"""Error types shared by every layer: ``InferenceError`` (a request cannot be served) and ``ConfigError``."""

from __future__ import annotations

import enum
from collections.abc import Mapping


class ErrorCode(enum.Enum):
    """Reference error codes with the HTTP status each one maps to."""

    BAD_REQUEST = ("BadRequest", 400)
    UNAUTHORIZED = ("Unauthorized", 401)
    FORBIDDEN = ("Forbidden", 403)
    NOT_FOUND = ("NotFound", 404)
    PAYLOAD_TOO_LARGE = ("PayloadTooLarge", 413)
    RESOURCE_EXHAUSTED = ("ResourceExhausted", 429)
    INTERNAL = ("Internal", 500)
    SERVICE_UNAVAILABLE = ("ServiceUnavailable", 503)

    def __init__(self, text: str, http_status: int) -> None:
        self.text = text
        self.http_status = http_status


class InferenceError(Exception):
    """A request-level failure with a code, a message and optional response headers.

    The ext_proc server answers it with an ``ImmediateResponse``: the HTTP status of its code and an
    OpenAI-style JSON body whose ``message`` is ``inference error: <Code> - <Msg>``.
    """

    def __init__(self, code: ErrorCode, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers: Mapping[str, str] = headers or {}

    def __str__(self) -> str:
        return f"inference error: {self.code.text} - {self.message}"


class SchedulingError(Exception):
    """Raised or returned by the scheduler when no endpoint could be picked (maps to 429)."""


class ConfigError(Exception):
    """A configuration error naming the field (dotted path) and the reason."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason
