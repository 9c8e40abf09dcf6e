"""``vllmhttp-parser``: vLLM's token-in ``/inference/v1/generate`` (outside the OpenAI surface).

The body is JSON with a non-empty ``token_ids`` array (uint32) and optional ``model``,
``sampling_params``, ``stream`` and ``cache_salt``. The token ids are the prompt; the model can be
rewritten as for OpenAI bodies. List ``openai-parser`` too to serve the OpenAI paths on the route.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework import ApiKind, Parser, RequestBody, register
from epp.framework.request import request_path
from epp.plugins.parsers._json import bad_request, load_object, token_ids

_GENERATE = "inference/v1/generate"


@register
class VllmHttpParser(Parser):
    type_name = "vllmhttp-parser"
    claims = (_GENERATE,)

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        path = request_path(headers)
        if not path.endswith(_GENERATE):
            raise bad_request(f"unsupported path: {path}")
        payload = load_object(body)
        ids = token_ids(payload.get("token_ids"))
        if ids is None:
            raise bad_request("invalid generate request: must have non-empty token_ids field")
        return RequestBody(
            api=ApiKind.GENERATE,
            payload=payload,
            raw=body,
            stream=payload.get("stream") is True,
            token_ids=ids,
        )
