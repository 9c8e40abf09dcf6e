"""``sglanghttp-parser``: SGLang's native ``/generate`` (outside the OpenAI surface).

The body is JSON with ``input_ids`` (one pre-tokenized prompt, uint32 ids) or ``text`` (one
string prompt), optional ``sampling_params``, ``stream``, ``cache_salt`` (the prefix-cache salt,
a string: what the engine salts its cache and its KV events with) and ``extra_key`` (a string the
engine also keys its cache on, absent from its KV events: not a salt here). SGLang serves one
model, so the body is scheduled with the model it names, if any, and forwarded unchanged. Only the
path ``/generate`` itself is served.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework import ApiKind, Parser, RequestBody, register
from epp.framework.request import request_path
from epp.plugins.parsers._json import bad_request, load_object, token_ids

_STRINGS = ("cache_salt", "extra_key")  # one prompt: SGLang takes a string (a list is for a batch)


@register
class SGLangHttpParser(Parser):
    type_name = "sglanghttp-parser"
    claims = ("generate",)

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        path = request_path(headers).strip().removesuffix("/")
        if path not in ("/generate", "generate"):
            raise bad_request(f"unsupported path: {path}")
        payload = load_object(body)
        for key in _STRINGS:
            value = payload.get(key)
            if value is not None and not isinstance(value, str):
                raise bad_request(f"unsupported generate request: {key} must be a string")
        raw_ids = payload.get("input_ids")
        ids: list[int] | None = None
        if raw_ids is not None:
            ids = token_ids(raw_ids)
            if ids is None:
                raise bad_request(
                    "invalid generate request: input_ids must be a non-empty array of uint32 integers"
                )
        else:
            text = payload.get("text")
            if not isinstance(text, str) or not text:
                raise bad_request("invalid generate request: input_ids or text must be provided")
        return RequestBody(
            api=ApiKind.GENERATE,
            payload=payload,
            raw=body,
            stream=payload.get("stream") is True,
            token_ids=ids,
            rewritable=False,
        )
