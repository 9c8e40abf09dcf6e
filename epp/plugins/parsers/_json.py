"""JSON helpers shared by the JSON parsers: the body object (and the wording of its 400s), token-id
arrays."""

from __future__ import annotations

from typing import Any

import orjson

from epp.framework import ErrorCode, InferenceError

_UINT32 = 1 << 32


def bad_request(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def json_kind(value: object) -> str:
    """What a decoded JSON value is, as a user reads it: "an array", "a string", "null"..."""
    return "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)


def not_json(error: Exception) -> InferenceError:
    """400 for a body that does not decode as JSON."""
    return bad_request(f"request body is not valid JSON: {error}")


def not_an_object(payload: object) -> InferenceError:
    """400 for a body that is JSON but not an object."""
    return bad_request(f"request body must be a JSON object, got {json_kind(payload)}")


def load_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; a 400 otherwise."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise not_json(e) from None
    if not isinstance(payload, dict):
        raise not_an_object(payload)
    return payload


def token_ids(value: Any) -> list[int] | None:
    """``value`` as a list of uint32 token ids, or ``None`` when it is not one (empty included)."""
    if not isinstance(value, list) or not value:
        return None
    for v in value:
        if type(v) is not int or not 0 <= v < _UINT32:
            return None
    return value
