"""``openai-parser``: the default request parser for OpenAI-style JSON bodies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from epp.framework import ApiKind, ErrorCode, InferenceError, Parser, RequestBody, register
from epp.framework.request import request_path
from epp.plugins.parsers._json import not_an_object, not_json
from epp.plugins.parsers._lazy_json import messages_object

_SUFFIXES: tuple[tuple[str, ApiKind], ...] = (
    ("/conversations", ApiKind.CONVERSATIONS),
    ("/responses", ApiKind.RESPONSES),
    ("/chat/completions", ApiKind.CHAT_COMPLETIONS),
    ("/chat/completions/render", ApiKind.CHAT_COMPLETIONS),
    ("/completions", ApiKind.COMPLETIONS),
    ("/completions/render", ApiKind.COMPLETIONS),
    ("/embeddings", ApiKind.EMBEDDINGS),
    ("/images/generations", ApiKind.IMAGES_GENERATIONS),
)


def api_for_path(path: str) -> ApiKind:
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in _SUFFIXES:
        if path.endswith(suffix):
            return api
    return ApiKind.COMPLETIONS


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


def _non_empty_prompt(value: Any) -> bool:
    """A string, or a non-empty array of strings or of integer token ids (not mixed)."""
    if isinstance(value, str):
        return value != ""
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return True
        return all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return False


_INVALID_MESSAGES = "invalid chat completions request: must have valid messages field"


def _validate(api: ApiKind, payload: dict[str, Any]) -> None:
    if api is ApiKind.CHAT_COMPLETIONS:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _bad(_INVALID_MESSAGES)
    elif api is ApiKind.COMPLETIONS:
        if not _non_empty_prompt(payload.get("prompt")):
            raise _bad("invalid completions request: must have prompt field")
    elif api is ApiKind.EMBEDDINGS:
        if not _non_empty_prompt(payload.get("input")):
            raise _bad("invalid embeddings request: must have input field")
    elif api is ApiKind.RESPONSES:
        if payload.get("input") is None:
            raise _bad("invalid responses request: must have input field")
    elif api is ApiKind.CONVERSATIONS:
        items = payload.get("items")
        if not isinstance(items, list) or not items:
            raise _bad("invalid conversations request: must have items field")
    elif api is ApiKind.IMAGES_GENERATIONS:
        prompt = payload.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _bad("invalid images generations request: must have prompt field")


# Chat bodies from this size on are read lazily (``_lazy_json``): a long agentic conversation is
# validated whole but converted only as far as it is read.
LAZY_FROM = 64 * 1024


def parse_json(body: bytes, api: ApiKind) -> RequestBody:
    """An OpenAI JSON body of API ``api``, checked for the field its prompt comes from."""
    if api is ApiKind.CHAT_COMPLETIONS and len(body) >= LAZY_FROM:
        lazy = messages_object(body)
        if lazy is not None:
            payload, messages = lazy
            if not messages:
                raise _bad(_INVALID_MESSAGES)
            return RequestBody(api=api, payload=payload, raw=body, stream=payload.get("stream") is True)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise not_json(e) from None
    if not isinstance(payload, dict):
        raise not_an_object(payload)
    _validate(api, payload)
    return RequestBody(api=api, payload=payload, raw=body, stream=payload.get("stream") is True)


@register
class OpenAIParser(Parser):
    type_name = "openai-parser"
    claims = (
        "chat/completions",
        "completions",
        "embeddings",
        "responses",
        "conversations",
        "chat/completions/render",
        "completions/render",
        "images/generations",
    )

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        return parse_json(body, api_for_path(request_path(headers)))
