"""``sglanghttp-parser``: SGLang's native ``/generate`` (outside the OpenAI surface).

The body is JSON with ``input_ids`` (one pre-tokenized prompt, uint32 ids) or ``text`` (one
string prompt), optional ``sampling_params``, ``stream`` and ``extra_key`` (the prefix-cache salt,
a string). SGLang serves one model, so the body is scheduled with the model it names, if any, and
forwarded unchanged. Only the path ``/generate`` itself is served.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework import ApiKind, Parser, RequestBody, register
from epp.framework.request import request_path
from epp.plugins.parsers._json import bad_request, load_object, token_ids


@register
class SGLangHttpParser(Parser):
    type_name = "sglanghttp-parser"
    claims = ("generate",)

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        path = request_path(headers).strip().removesuffix("/")
        if path not in ("/generate", "generate"):
            raise bad_request(f"unsupported path: {path}")
        payload = load_object(body)
        salt = payload.get("extra_key")
        if salt is not None and not isinstance(salt, str):
            raise bad_request("unsupported generate request: extra_key must be a string")
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
