"""Error types shared by every layer: ``InferenceError`` (a request cannot be served) and ``ConfigError``."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from epp.framework.wire import REQUEST_DROPPED_REASON_HEADER


class ErrorCode(enum.Enum):
    """Reference error codes with the HTTP status each one maps to."""

    BAD_REQUEST = ("BadRequest", 400, "invalid_request_error")
    UNAUTHORIZED = ("Unauthorized", 401, "authentication_error")
    FORBIDDEN = ("Forbidden", 403, "permission_error")
    NOT_FOUND = ("NotFound", 404, "not_found_error")
    PAYLOAD_TOO_LARGE = ("PayloadTooLarge", 413, "request_too_large")
    RESOURCE_EXHAUSTED = ("ResourceExhausted", 429, "rate_limit_error")
    INTERNAL = ("Internal", 500, "server_error")
    SERVICE_UNAVAILABLE = ("ServiceUnavailable", 503, "service_unavailable")

    def __init__(self, text: str, http_status: int, error_type: str) -> None:
        self.text = text  # the reference's code, in the message and the metrics' error_code label
        self.http_status = http_status
        self.error_type = error_type  # the OpenAI-style ``type`` of the JSON error body


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
        self.model = ""  # the model the rejected request's body named, for the error metrics' labels

    def __str__(self) -> str:
        return f"inference error: {self.code.text} - {self.message}"


class DroppedReason(enum.StrEnum):
    """Values of the ``x-llm-d-request-dropped-reason`` response header, the reference's vocabulary."""

    SATURATED = "rejected-saturated"  # 429: capacity exists but is contended
    NO_ENDPOINTS = "rejected-no-endpoints"  # 503: nothing can serve the request now
    TTL_EXPIRED = "rejected-ttl-expired"  # 429: waited out its queue TTL
    CONTEXT_CANCELLED = "rejected-context-cancelled"  # 503: the client went away while queued
    SHUTTING_DOWN = "rejected-shutting-down"  # 503
    EVICTED = "evicted"  # 429: dispatched, then revoked by flow control's eviction


def dropped(code: ErrorCode, message: str, reason: DroppedReason) -> InferenceError:
    """A rejection carrying the ``x-llm-d-request-dropped-reason`` header."""
    return InferenceError(code, message, headers={REQUEST_DROPPED_REASON_HEADER: reason.value})


def saturated(message: str) -> InferenceError:
    """429 ``rejected-saturated``: the pool is busy (the filters left no candidate)."""
    return dropped(ErrorCode.RESOURCE_EXHAUSTED, message, DroppedReason.SATURATED)


def no_endpoints(message: str) -> InferenceError:
    """503 ``rejected-no-endpoints``: no candidate endpoint exists for the request."""
    return dropped(ErrorCode.SERVICE_UNAVAILABLE, message, DroppedReason.NO_ENDPOINTS)


class SchedulingError(Exception):
    """Raised or returned by the scheduler when no endpoint could be picked (maps to 429)."""


class FiltersDrainedError(SchedulingError):
    """A profile's filters removed every candidate: the pool is busy, not empty (429, saturated)."""


class ConfigError(Exception):
    """A configuration error naming the field (dotted path) and the reason."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


class ConfigErrors(ConfigError):
    """Several independent configuration errors found in one load, in the order found.

    ``field`` and ``reason`` are the first error's (what a single error would have said); ``errors``
    holds them all and the text lists them one per line.
    """

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        if not errors:
            raise ValueError("ConfigErrors needs at least one error")
        super().__init__(errors[0].field, errors[0].reason)
        self.errors: tuple[ConfigError, ...] = tuple(errors)

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)
