"""``passthrough-parser``: any body, not interpreted.

It claims no path, so listed last it takes every request no other parser claims. The request is
scheduled without a model or prompt (load- and metric-based plugins still apply; prefix-aware ones
see an empty prompt) and forwarded unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework import ApiKind, Parser, RequestBody, register


@register
class PassthroughParser(Parser):
    type_name = "passthrough-parser"
    claims = ()

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        return RequestBody(api=ApiKind.RAW, payload={}, raw=body, rewritable=False)

    def supported_app_protocols(self) -> tuple[str, ...]:
        return ()
