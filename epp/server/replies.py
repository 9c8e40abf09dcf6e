"""Builders for the ``ProcessingResponse`` messages the EPP sends to Envoy (upb classes of xds-protos)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from epp.framework.errors import InferenceError
from epp.framework.interfaces import LocalResponse
from epp.framework.wire import (
    DESTINATION_HEADER,
    ENDPOINT_SCORES_KEY,
    FALLBACK_HEADER,
    LB_NAMESPACE,
    REWRITE_METADATA_KEY,
)

BODY_PIECE_LIMIT = 62000

ProcessingResponse = ep.ProcessingResponse


def header_mutation(set_headers: Mapping[str, str], remove: Iterable[str] = ()) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode())) for k, v in set_headers.items()
        ],
        remove_headers=list(remove),
    )


def destination_metadata(destination: str) -> Struct:
    md = Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
    return md


def routing_common(
    set_headers: Mapping[str, str], remove: Iterable[str], body: bytes | None = None
) -> ep.CommonResponse:
    """The CommonResponse that routes the request: header mutation plus ``clear_route_cache``."""
    common = ep.CommonResponse(clear_route_cache=True, header_mutation=header_mutation(set_headers, remove))
    if body is not None:
        common.body_mutation.body = body
    return common


_ROUTED: dict[tuple[bool, str, str], ep.ProcessingResponse] = {}
_ROUTED_LIMIT = 4096  # distinct (destination, fallback) pairs kept


def routing_reply(
    destination: str,
    *,
    on_body: bool,
    set_headers: Mapping[str, str] | None = None,
    remove: Iterable[str] = (),
    body: bytes | None = None,
    private: bool = False,
    fallback: str = "",
) -> ep.ProcessingResponse:
    """The reply that routes: ``clear_route_cache``, the destination header (first) and metadata,
    the fail-over endpoint header when ``fallback``, then ``set_headers``, ``remove`` and a
    replaced ``body``; a request-body reply when ``on_body``.

    The reply that only routes, by far the most common one, is built once per destination and
    shared: nobody may change it. Anything more, or ``private``, starts from a copy of it.
    """
    key = (on_body, destination, fallback)
    base = _ROUTED.get(key)
    if base is None:
        if len(_ROUTED) >= _ROUTED_LIMIT:
            _ROUTED.clear()
        routed = {DESTINATION_HEADER: destination, FALLBACK_HEADER: fallback} if fallback else {}
        common = routing_common(routed or {DESTINATION_HEADER: destination}, ())
        base = _ROUTED[key] = (
            request_body_reply(common, destination) if on_body else request_headers_reply(common, destination)
        )
    if not (set_headers or remove or body is not None or private):
        return base
    resp = ep.ProcessingResponse()
    resp.CopyFrom(base)
    common = resp.request_body.response if on_body else resp.request_headers.response
    mutation = common.header_mutation
    if set_headers:
        mutation.set_headers.extend(
            HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode())) for k, v in set_headers.items()
        )
    if remove:
        mutation.remove_headers.extend(remove)
    if body is not None:
        common.body_mutation.body = body
    return resp


def request_headers_reply(
    common: ep.CommonResponse | None = None,
    destination: str | None = None,
    mode_override: pm.ProcessingMode | None = None,
) -> ep.ProcessingResponse:
    resp = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common or ep.CommonResponse()))
    if destination is not None:
        resp.dynamic_metadata.CopyFrom(destination_metadata(destination))
    if mode_override is not None:
        resp.mode_override.CopyFrom(mode_override)
    return resp


# Sent in the request-headers reply of a BUFFERED request whose response nothing reads: the rest of
# the exchange is the body message and its reply; the trailers mode keeps the stream open to the
# response end (in-flight accounting).
NO_RESPONSE_PHASES = pm.ProcessingMode(
    request_header_mode=pm.ProcessingMode.SEND,
    response_header_mode=pm.ProcessingMode.SKIP,
    request_body_mode=pm.ProcessingMode.BUFFERED,
    response_body_mode=pm.ProcessingMode.NONE,
    request_trailer_mode=pm.ProcessingMode.SKIP,
    response_trailer_mode=pm.ProcessingMode.SEND,
)


def add_rewrite_metadata(resp: ep.ProcessingResponse, incoming: str, target: str) -> None:
    """Mark a routing reply as model-rewritten (see ``REWRITE_METADATA_KEY``)."""
    ns = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value
    models = ns.fields[REWRITE_METADATA_KEY].struct_value
    models.fields["incoming"].string_value = incoming
    models.fields["target"].string_value = target


def add_endpoint_scores(resp: ep.ProcessingResponse, scores: Mapping[str, float]) -> None:
    """``envoy.lb`` / ``x-gateway-destination-endpoint-scores``: each destination ``ip:port`` -> its score."""
    fields = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[ENDPOINT_SCORES_KEY].struct_value
    for hostport, score in scores.items():
        fields.fields[hostport].number_value = score


def add_dynamic_metadata(resp: ep.ProcessingResponse, metadata: Mapping[str, Mapping[str, object]]) -> None:
    """Merge ``{namespace: {key: value}}`` (JSON-like values) into a reply's dynamic metadata."""
    for namespace, values in metadata.items():
        resp.dynamic_metadata.fields[namespace].struct_value.update(values)


def rewrite_models(metadata: Mapping[str, Mapping[str, object]]) -> tuple[str, str] | None:
    """``(incoming, target)`` from the merged metadata of a stream, if the request was rewritten."""
    models = metadata.get(LB_NAMESPACE, {}).get(REWRITE_METADATA_KEY)
    if isinstance(models, Mapping):
        incoming, target = models.get("incoming"), models.get("target")
        if isinstance(incoming, str) and isinstance(target, str) and incoming and target:
            return incoming, target
    return None


# Sent in the response-headers reply of a rewritten request in BUFFERED mode: Envoy then streams this
# one response's body to the EPP (FULL_DUPLEX_STREAMED needs the trailers too). Envoy 1.40 honours
# it only when the request body mode is not FULL_DUPLEX_STREAMED.
_RESPONSE_BODY_OVERRIDE = pm.ProcessingMode(
    request_header_mode=pm.ProcessingMode.SEND,
    response_header_mode=pm.ProcessingMode.SEND,
    request_body_mode=pm.ProcessingMode.BUFFERED,
    response_body_mode=pm.ProcessingMode.FULL_DUPLEX_STREAMED,
    request_trailer_mode=pm.ProcessingMode.SKIP,
    response_trailer_mode=pm.ProcessingMode.SEND,
)


def request_body_reply(
    common: ep.CommonResponse | None = None, destination: str | None = None
) -> ep.ProcessingResponse:
    """A body reply in BUFFERED mode (may carry the routing header mutation)."""
    resp = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common or ep.CommonResponse()))
    if destination is not None:
        resp.dynamic_metadata.CopyFrom(destination_metadata(destination))
    return resp


_EMPTY_REQUEST_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())


def chunk_replies(count: int, body: bytes | None = None) -> list[ep.ProcessingResponse]:
    """STREAMED request body: one reply per chunk received; nothing echoed back.

    ``body`` (a rewritten request) replaces the first chunk and clears the others.
    """
    if body is None:
        return [_EMPTY_REQUEST_BODY] * count
    out = [ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse()))]
    out[0].request_body.response.body_mutation.body = body
    for _ in range(count - 1):
        cleared = ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse()))
        cleared.request_body.response.body_mutation.clear_body = True
        out.append(cleared)
    return out


def streamed_body_pieces(body: bytes, end_of_stream: bool) -> Iterator[ep.ProcessingResponse]:
    """The request body re-sent in FULL_DUPLEX_STREAMED pieces, each built only when it is written
    (the replies never hold a second copy of a long body at once)."""
    n = len(body)
    last = max(n - 1, 0) // BODY_PIECE_LIMIT * BODY_PIECE_LIMIT
    for i in range(0, max(n, 1), BODY_PIECE_LIMIT):
        resp = ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse()))
        piece = resp.request_body.response.body_mutation.streamed_response
        piece.body = body[i : i + BODY_PIECE_LIMIT]
        piece.end_of_stream = end_of_stream and i == last
        yield resp


def streamed_body_replies(
    body: bytes, end_of_stream: bool, response: bool = False
) -> list[ep.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED body pieces of at most 62000 bytes; ``end_of_stream`` only on the last."""
    pieces = [body[i : i + BODY_PIECE_LIMIT] for i in range(0, len(body), BODY_PIECE_LIMIT)] or [b""]
    last = len(pieces) - 1
    out = []
    for i, piece in enumerate(pieces):
        common = ep.CommonResponse(
            body_mutation=ep.BodyMutation(
                streamed_response=ep.StreamedBodyResponse(
                    body=piece, end_of_stream=end_of_stream and i == last
                )
            )
        )
        br = ep.BodyResponse(response=common)
        out.append(
            ep.ProcessingResponse(response_body=br) if response else ep.ProcessingResponse(request_body=br)
        )
    return out


def response_headers_reply(
    set_headers: Mapping[str, str], remove: Iterable[str] = (), *, want_body: bool = False
) -> ep.ProcessingResponse:
    """``want_body``: ask for this response's body (mode override, BUFFERED request mode only)."""
    common = ep.CommonResponse()
    if set_headers or remove:
        common.header_mutation.CopyFrom(header_mutation(set_headers, remove))
    resp = ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))
    if want_body:
        resp.mode_override.CopyFrom(_RESPONSE_BODY_OVERRIDE)
    return resp


def response_body_reply(body: bytes | None = None) -> ep.ProcessingResponse:
    """A response-body reply in BUFFERED/STREAMED mode (optionally replacing the chunk)."""
    common = ep.CommonResponse()
    if body is not None:
        common.body_mutation.body = body
    return ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))


def message_timeout_override(seconds: float) -> ep.ProcessingResponse:
    """Extends Envoy's timer for the pending message (once per message; BUFFERED/STREAMED modes).

    Honoured only when the filter sets ``max_message_timeout`` at or above ``seconds``.
    """
    resp = ep.ProcessingResponse()
    whole = int(seconds)
    resp.override_message_timeout.seconds = whole
    resp.override_message_timeout.nanos = int((seconds - whole) * 1e9)
    return resp


def request_trailers_reply() -> ep.ProcessingResponse:
    return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())


def response_trailers_reply() -> ep.ProcessingResponse:
    return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def error_body(err: InferenceError) -> bytes:
    """OpenAI-style error JSON: ``message`` holds the reference text ``inference error: <Code> - <Msg>``,
    ``type`` the OpenAI error type (``invalid_request_error``, ``rate_limit_error``, ...), ``code``
    the HTTP status."""
    return orjson.dumps(
        {
            "error": {
                "message": str(err),
                "type": err.code.error_type,
                "param": None,
                "code": err.code.http_status,
            }
        }
    )


# A 429 or 503 of the EPP (saturation, flow control, no endpoint yet) tells clients when to retry.
RETRY_AFTER_SECONDS = "1"
_RETRY_STATUSES = frozenset((429, 503))


def immediate_local(answer: LocalResponse) -> ep.ProcessingResponse:
    """A responder plugin's answer, sent instead of routing."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=HttpStatus(code=answer.status),
            headers=header_mutation(dict(answer.headers)),
            body=answer.body,
            details="epp_local_response",
        )
    )


def immediate_error(err: InferenceError) -> ep.ProcessingResponse:
    """The rejection reply: status, JSON body, the error's headers (e.g. the drop reason); a 429 or
    503 also carries ``retry-after`` (unless the error sets its own)."""
    headers = {"content-type": "application/json", **err.headers}
    if err.code.http_status in _RETRY_STATUSES:
        headers.setdefault("retry-after", RETRY_AFTER_SECONDS)
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=HttpStatus(code=err.code.http_status),
            headers=header_mutation(headers),
            body=error_body(err),
            details=f"epp_{err.code.text}",
        )
    )
