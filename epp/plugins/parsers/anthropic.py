"""``anthropic-parser``: Anthropic Messages API bodies (``/v1/messages``, ``/v1/messages/count_tokens``).

A messages request is a JSON object with a non-empty ``messages`` array; its ``system``, ``tools``
and ``messages`` are the prompt. A ``count_tokens`` request is forwarded unread: it is scheduled
without a model or prompt and never rewritten.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from epp.framework import ApiKind, ErrorCode, InferenceError, Parser, RequestBody, register
from epp.framework.request import request_path
from epp.plugins.parsers._json import not_an_object, not_json

_MESSAGES = "messages"
_COUNT_TOKENS = "messages/count_tokens"


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


@register
class AnthropicParser(Parser):
    type_name = "anthropic-parser"
    claims = (_MESSAGES, _COUNT_TOKENS)

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        path = request_path(headers)
        if path.endswith("/" + _COUNT_TOKENS):
            return RequestBody(api=ApiKind.RAW, payload={}, raw=body, rewritable=False)
        if not path.endswith("/" + _MESSAGES):
            raise _bad(f"unsupported API endpoint: {path}")
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise not_json(e) from None
        if not isinstance(payload, dict):
            raise not_an_object(payload)
        messages = payload.get("messages")
        if messages is not None and (
            not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages)
        ):
            raise _bad("error parsing messages request: messages must be an array of objects")
        if not messages:
            raise _bad("invalid messages request: must have at least one message")
        system = payload.get("system")
        if system is not None and not isinstance(system, str | list):
            raise _bad(
                "error parsing messages request: system must be a string or an array of content blocks"
            )
        return RequestBody(
            api=ApiKind.MESSAGES, payload=payload, raw=body, stream=payload.get("stream") is True
        )
