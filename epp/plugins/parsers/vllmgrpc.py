"""``vllmgrpc-parser``: vLLM's gRPC engine service (``vllm.grpc.engine.VllmEngine``).

Requests are gRPC over HTTP/2 (``application/grpc``): one length-prefixed protobuf message.
``Generate`` (``GenerateRequest``: ``tokenized.input_ids`` or ``text``, ``sampling_params``,
``stream``) and ``Embed`` (``EmbedRequest``: ``tokenized.input_ids``) are read for their prompt;
neither names a model, and the body is forwarded unchanged. Other methods are routed unread.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework import ApiKind, Parser, RequestBody, register
from epp.plugins.parsers._grpc import (
    LENGTH,
    VARINT,
    WireError,
    bad_request,
    fields,
    grpc_message,
    message,
    text,
    uint32s,
)

_GENERATE = "vllm.grpc.engine.VllmEngine/Generate"
_EMBED = "vllm.grpc.engine.VllmEngine/Embed"

# Field numbers of vllm_engine.proto (proto/vllm_engine.proto).
_GEN_TOKENIZED, _GEN_TEXT, _GEN_STREAM = 2, 3, 5
_EMBED_TOKENIZED = 2
_TOKENIZED_INPUT_IDS = 2


def _input_ids(tokenized: bytes) -> list[int]:
    ids: list[int] = []
    for number, wire, value in fields(tokenized):
        if number == _TOKENIZED_INPUT_IDS:
            uint32s(wire, value, ids)
    return ids


def _generate(msg: bytes, raw: bytes) -> RequestBody:
    ids: list[int] | None = None
    prompt: str | None = None
    stream = False
    for number, wire, value in fields(msg):
        if number == _GEN_TOKENIZED:  # oneof input: the last one wins
            ids, prompt = _input_ids(message(wire, value)), None
        elif number == _GEN_TEXT:
            ids, prompt = None, text(wire, value)
        elif number == _GEN_STREAM and wire == VARINT:
            stream = value != 0
    if ids is None and prompt is None:
        raise bad_request("not supported request inputType")
    return RequestBody(
        api=ApiKind.GENERATE,
        payload={} if prompt is None else {"prompt": prompt},
        raw=raw,
        stream=stream,
        token_ids=ids,
        rewritable=False,
    )


def _embed(msg: bytes, raw: bytes) -> RequestBody:
    ids: list[int] | None = None
    for number, wire, value in fields(msg):
        if number == _EMBED_TOKENIZED and wire == LENGTH:
            ids = _input_ids(message(wire, value))
    if ids is None:
        raise bad_request("missing tokenized input in EmbedRequest")
    return RequestBody(api=ApiKind.EMBEDDINGS, payload={}, raw=raw, token_ids=ids, rewritable=False)


@register
class VllmGrpcParser(Parser):
    type_name = "vllmgrpc-parser"
    claims = (_GENERATE, _EMBED)

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody:
        try:
            msg = grpc_message(body)
        except ValueError:
            raise bad_request("invalid or unsupported gRPC payload") from None
        path = headers.get(":path", "")
        try:
            if path.endswith(_EMBED):
                return _embed(msg, body)
            if path.endswith(_GENERATE):
                return _generate(msg, body)
        except WireError as e:
            what = "EmbedRequest" if path.endswith(_EMBED) else "GenerateRequest"
            raise bad_request(f"{what} is not a valid protobuf message: {e}") from None
        return RequestBody(api=ApiKind.RAW, payload={}, raw=body, rewritable=False)

    def supported_app_protocols(self) -> tuple[str, ...]:
        return ("kubernetes.io/h2c",)
