"""JSON helpers shared by the JSON parsers: the body object and token-id arrays."""

from __future__ import annotations

from typing import Any

import orjson

from epp.framework import ErrorCode, InferenceError

_UINT32 = 1 << 32


def bad_request(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


def load_object(body: bytes, what: str) -> dict[str, Any]:
    """The body as a JSON object; 400 naming ``what`` (e.g. "generate request") otherwise."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"invalid {what}: {e}") from None
    if not isinstance(payload, dict):
        raise bad_request(f"invalid {what}: expected a JSON object, got {type(payload).__name__}")
    return payload


def token_ids(value: Any) -> list[int] | None:
    """``value`` as a list of uint32 token ids, or ``None`` when it is not one (empty included)."""
    if not isinstance(value, list) or not value:
        return None
    for v in value:
        if type(v) is not int or not 0 <= v < _UINT32:
            return None
    return value
