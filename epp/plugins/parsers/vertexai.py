"""``vertexai-parser``: Vertex AI's gRPC ``PredictionService`` carrying OpenAI JSON.

``ChatCompletions``, ``RawPredict`` and ``StreamRawPredict`` requests are one gRPC-framed protobuf
message whose ``http_body`` (a ``google.api.HttpBody``) holds an OpenAI JSON body in ``data``: read
as a chat completions body (``ChatCompletions``) or a responses body (the raw predicts). The model
is the JSON's ``model``; the gRPC body is forwarded unchanged. Other methods are routed unread.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework import ApiKind, InferenceError, Parser, RequestBody, register
from epp.plugins.parsers._grpc import WireError, bad_request, fields, grpc_message, message
from epp.plugins.parsers.openai import parse_json

# (method suffix, request message name, OpenAI API of the embedded JSON)
_METHODS: tuple[tuple[str, str, ApiKind], ...] = (
    ("PredictionService/ChatCompletions", "ChatCompletionsRequest", ApiKind.CHAT_COMPLETIONS),
    ("PredictionService/StreamRawPredict", "StreamRawPredictRequest", ApiKind.RESPONSES),
    ("PredictionService/RawPredict", "RawPredictRequest", ApiKind.RESPONSES),
)
_HTTP_BODY = 2  # in all three request messages
_HTTP_BODY_DATA = 2  # google.api.HttpBody.data


def _http_body_data(msg: bytes) -> bytes | None:
    body: bytes | None = None
    for number, wire, value in fields(msg):
        if number == _HTTP_BODY:
            body = message(wire, value)
    if body is None:
        return None
    data = b""
    for number, wire, value in fields(body):
        if number == _HTTP_BODY_DATA:
            data = message(wire, value)
    return data


@register
class VertexAIParser(Parser):
    type_name = "vertexai-parser"
    claims = tuple(m[0] for m in _METHODS)

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        path = headers.get(":path", "")
        method = next((m for m in _METHODS if path.endswith(m[0])), None)
        if method is None:
            return RequestBody(api=ApiKind.RAW, payload={}, raw=body, rewritable=False)
        _, name, api = method
        try:
            msg = grpc_message(body)
        except ValueError as e:
            raise bad_request(f"invalid or unsupported gRPC payload: {e}") from None
        try:
            data = _http_body_data(msg)
        except WireError as e:
            raise bad_request(f"{name} is not a valid protobuf message: {e}") from None
        if data is None:
            raise bad_request(f"{name} has no HttpBody")
        try:
            parsed = parse_json(data, api)
        except InferenceError as e:
            raise bad_request(f"parsing {name}: {e.message}") from None
        parsed.raw = body
        parsed.rewritable = False
        return parsed

    def supported_app_protocols(self) -> tuple[str, ...]:
        return ("kubernetes.io/h2c",)
