"""Kubernetes ``Status`` objects and the exception that carries one to an HTTP error response."""

from __future__ import annotations

from typing import Any

#: The ``reason`` the API server reports for each HTTP status code it uses.
REASONS: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status_object(
    code: int, message: str, reason: str | None = None, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A failure ``Status`` as the API server serialises it (``reason`` defaults from ``code``)."""
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details is not None:
        status["details"] = details
    return status


class ApiError(Exception):
    """An error the fake answers with a ``Status`` body and the same HTTP status code."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.status = status_object(code, message, reason, details)
        self.headers = headers or {}

    @classmethod
    def not_found(cls, resource: str, name: str, group: str, kind_plural: str) -> ApiError:
        """``<resource> "<name>" not found`` (404), with the details the API server adds."""
        return cls(
            404,
            f'{resource} "{name}" not found',
            details={"name": name, "group": group, "kind": kind_plural},
        )

    @classmethod
    def no_such_path(cls) -> ApiError:
        """The 404 the API server answers for a path it does not serve (e.g. a CRD not installed)."""
        return cls(404, "the server could not find the requested resource", details={})

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        """A 400 BadRequest."""
        return cls(400, message)
