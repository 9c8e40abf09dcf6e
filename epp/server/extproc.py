"""The ext_proc stream handler: one gRPC stream per HTTP request.

Message flow (protocol.md §1), per request body mode announced in ``protocol_config``:

* FULL_DUPLEX_STREAMED (the reference mode): headers -> nothing; body chunks are buffered until
  ``end_of_stream`` (or the request trailers, quirk Q7); then one request-headers reply with the
  routing header mutation, ``envoy.lb`` metadata and ``clear_route_cache``, followed by the body in
  ``streamed_response`` pieces of at most 62000 bytes (and a trailers reply when trailers came).
* BUFFERED: headers -> an empty reply (continue); the whole body -> a body reply carrying the
  routing header mutation and metadata (and the body only when the model was rewritten).
* Headers with ``end_of_stream`` (GET) -> a random candidate, answered at once.

Response headers are answered at once; response bodies are passed through (re-chunked in
FULL_DUPLEX mode, buffered when not streaming) with the model name rewritten back when it was
rewritten on the way in. The shipped bootstraps send response bodies only for rewritten requests:
in BUFFERED mode the response-headers reply asks for it (``mode_override``); in FULL_DUPLEX mode a
second ext_proc filter opens a stream of response messages only (no routing, the rewrite in its
``envoy.lb`` metadata). The stream stays open until the HTTP stream ends (response trailers SEND).

Failures become an ``ImmediateResponse`` and the stream ends cleanly; an unexpected exception
ends the stream with gRPC UNKNOWN (Envoy's failure mode decides) without touching other streams.
However the stream ends, in-flight accounting is released.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from epp import metrics
from epp.framework import (
    ErrorCode,
    InferenceError,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    ResponseInfo,
)
from epp.server import replies
from epp.server.body_rewrite import model_literal_pairs, replace_existing_model
from epp.server.director import EPP_OWNED_HEADERS, REQUEST_ID_HEADER, Director, Routing

log = structlog.get_logger("epp.extproc")

# ProcessingMode.BodySendMode values (envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto)
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED = 0, 1, 2, 3, 4

_NEVER_ECHO = frozenset({"content-length", replies.DESTINATION_HEADER})


class StreamOptions:
    """Server-wide knobs of the stream handler."""

    __slots__ = ("debug_response_header", "max_body_bytes", "response_body", "response_header")

    def __init__(
        self,
        max_body_bytes: int = 10 << 20,
        debug_response_header: bool = True,
        response_header: tuple[ResponseHeaderProcessor, ...] = (),
        response_body: tuple[ResponseBodyProcessor, ...] = (),
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.debug_response_header = debug_response_header
        self.response_header = response_header
        self.response_body = response_body


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    return {
        h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in msg.headers.headers
    }


def _is_event_stream(msg: ep.HttpHeaders) -> bool:
    """Whether the response's content-type is SSE, without building the header map."""
    for h in msg.headers.headers:
        if h.key == "content-type":
            return b"text/event-stream" in h.raw_value or "text/event-stream" in h.value
    return False


# Replies that never change, built once.
_RESPONSE_HEADERS_DEBUG = replies.response_headers_reply({"x-went-into-resp-headers": "true"})
_RESPONSE_HEADERS_PLAIN = replies.response_headers_reply({})
_CONTINUE_REQUEST_HEADERS = replies.request_headers_reply()


def _struct_value(v: Any) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return v.string_value
    if kind == "list_value":
        return [_struct_value(x) for x in v.list_value.values]
    if kind == "struct_value":
        return {k: _struct_value(x) for k, x in v.struct_value.fields.items()}
    if kind == "number_value":
        return v.number_value
    if kind == "bool_value":
        return v.bool_value
    return None


def _merge_metadata(into: dict[str, dict[str, Any]], req: ep.ProcessingRequest) -> None:
    """Merge (not replace, quirk Q17) the request's filter metadata into ``into``."""
    for ns, st in req.metadata_context.filter_metadata.items():
        into.setdefault(ns, {}).update({k: _struct_value(v) for k, v in st.fields.items()})


class _Stream:
    """State of one ext_proc stream (one HTTP request)."""

    __slots__ = (
        "body_size",
        "chunks",
        "director",
        "error",
        "header_only",
        "headers",
        "metadata",
        "model_pairs",
        "opts",
        "req_mode",
        "request_id_generated",
        "resp_buffer",
        "resp_mode",
        "resp_streaming",
        "response",
        "reverse",
        "routing",
        "started",
        "t_received",
    )

    def __init__(self, director: Director, opts: StreamOptions) -> None:
        self.director = director
        self.opts = opts
        self.req_mode = FULL_DUPLEX_STREAMED
        self.resp_mode = FULL_DUPLEX_STREAMED
        self.headers: dict[str, str] = {}
        self.metadata: dict[str, dict[str, Any]] = {}
        self.chunks: list[bytes] = []
        self.body_size = 0
        self.routing: Routing | None = None
        self.started = False  # in-flight accounting began
        self.error: InferenceError | None = None
        self.header_only = False
        self.request_id_generated = False
        self.resp_streaming = False
        self.resp_buffer: list[bytes] = []
        self.response: ResponseInfo | None = None
        self.t_received = 0.0
        self.model_pairs: tuple[tuple[bytes, bytes], ...] | None = None
        self.reverse: tuple[str, str] | None = None  # (incoming, target) to undo in the response body

    # --- request path ------------------------------------------------------------------------

    def on_request_headers(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if req.HasField("protocol_config"):
            pc = req.protocol_config
            self.req_mode = pc.request_body_mode
            self.resp_mode = pc.response_body_mode
        self.t_received = time.monotonic()
        msg = req.request_headers
        headers = self.headers = _headers(msg)
        if not headers.get(REQUEST_ID_HEADER):
            headers[REQUEST_ID_HEADER] = str(uuid.uuid4())
            self.request_id_generated = True
        if msg.end_of_stream or self.req_mode == NONE:
            # No body will come: a random candidate, answered now.
            self.header_only = True
            routing = self.director.route_random(self.metadata)
            return [self._routing_reply(routing, content_length=False)]
        if self.req_mode in (STREAMED, BUFFERED_PARTIAL):
            raise InferenceError(
                ErrorCode.INTERNAL,
                "unsupported ext_proc request_body_mode: use FULL_DUPLEX_STREAMED or BUFFERED",
            )
        if self.req_mode == BUFFERED:
            return [_CONTINUE_REQUEST_HEADERS]
        return []

    async def on_request_body(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        msg = req.request_body
        if msg.body:
            self.chunks.append(msg.body)
            self.body_size += len(msg.body)
            if self.body_size > self.opts.max_body_bytes:
                raise InferenceError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"request body exceeds {self.opts.max_body_bytes} bytes (--max-request-body-bytes)",
                )
        if not msg.end_of_stream:
            return []
        return await self._route_body(trailers=False)

    async def on_request_trailers(self) -> list[ep.ProcessingResponse]:
        # The reference ignores request trailers and hangs (quirk Q7): they end the body instead.
        if self.routing is not None:
            return [replies.request_trailers_reply()]
        out = await self._route_body(trailers=True)
        out.append(replies.request_trailers_reply())
        return out

    async def _route_body(self, trailers: bool) -> list[ep.ProcessingResponse]:
        raw = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        routing = await self.director.route(dict(self.headers), raw, self.metadata)
        if self.req_mode == BUFFERED:
            return [self._routing_reply(routing, content_length=routing.body_changed)]
        out = [self._routing_reply(routing, content_length=True)]
        out.extend(replies.streamed_body_replies(routing.body, end_of_stream=not trailers))
        return out

    def _routing_reply(self, routing: Routing, content_length: bool) -> ep.ProcessingResponse:
        """The reply that routes: destination header and metadata, header changes, removals."""
        self.routing = routing
        set_headers = {replies.DESTINATION_HEADER: routing.destination}
        client = self.headers
        if self.request_id_generated:
            set_headers[REQUEST_ID_HEADER] = client[REQUEST_ID_HEADER]
        if content_length and routing.body:
            set_headers["content-length"] = str(len(routing.body))
        request = routing.request
        if request is not None:
            for k, v in request.headers.items():  # headers set or changed by PreRequest plugins
                if (client.get(k) != v or k in EPP_OWNED_HEADERS) and k not in _NEVER_ECHO and k[0] != ":":
                    set_headers[k] = v
        remove = [k for k in EPP_OWNED_HEADERS if k in client and k not in set_headers]
        common = replies.routing_common(
            set_headers, remove, routing.body if self.req_mode == BUFFERED and routing.body_changed else None
        )
        self.director.begin(routing)
        self.started = True
        if routing.request is not None:
            r = routing.request
            metrics.REQUEST_TOTAL.labels(r.incoming_model, r.target_model, str(r.priority)).inc()
            metrics.REQUEST_SIZES.labels(r.incoming_model, r.target_model).observe(len(routing.body))
            metrics.RUNNING_REQUESTS.labels(r.incoming_model).inc()
        if self.req_mode == BUFFERED and not self.header_only:
            reply = replies.request_body_reply(common, routing.destination)
        else:
            reply = replies.request_headers_reply(common, routing.destination)
        if routing.body_changed and request is not None:
            replies.add_rewrite_metadata(reply, request.incoming_model, request.target_model)
        return reply

    # --- response path -----------------------------------------------------------------------

    def _reverse_models(self) -> tuple[str, str] | None:
        """``(incoming, target)`` when this stream must undo a model rewrite in the response body.

        The routing stream does it when it gets the body: a response body mode is configured, or the
        request body mode is BUFFERED (then the response-headers reply asks for the body). In
        FULL_DUPLEX_STREAMED mode that ask is ignored by Envoy, so the bootstrap routes rewritten
        requests to a second ext_proc filter whose stream (no routing, the rewrite in its
        ``envoy.lb`` metadata) starts at the response headers and rewrites the body.
        """
        routing = self.routing
        if routing is None:
            return replies.rewrite_models(self.metadata)
        request = routing.request
        if not routing.body_changed or request is None:
            return None
        if self.resp_mode == NONE and self.req_mode != BUFFERED:
            return None
        return request.incoming_model, request.target_model

    def on_response_headers(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        opts, routing = self.opts, self.routing
        reverse = self.reverse = self._reverse_models()
        if not opts.response_header and not opts.response_body and reverse is None:
            # Nothing looks at the response: only note whether its body will be an event stream.
            request = routing.request if routing is not None else None
            self.resp_streaming = bool(request is not None and request.stream) or _is_event_stream(
                req.response_headers
            )
            return [_RESPONSE_HEADERS_DEBUG if opts.debug_response_header else _RESPONSE_HEADERS_PLAIN]
        headers = _headers(req.response_headers)
        status = headers.get(":status") or headers.get("status") or "0"
        self.response = response = ResponseInfo(
            headers=headers, status=int(status) if status.isdigit() else 0
        )
        request = routing.request if routing is not None else None
        self.resp_streaming = bool(
            (request is not None and request.stream) or "text/event-stream" in headers.get("content-type", "")
        )
        set_headers: dict[str, str] = {}
        if self.opts.debug_response_header:
            set_headers["x-went-into-resp-headers"] = "true"
        if self.opts.response_header and request is not None:
            before = dict(headers)
            endpoint = routing.endpoints[0] if routing and routing.endpoints else None
            for plugin in self.opts.response_header:
                plugin.response_header(request, response, endpoint)
            set_headers.update({k: v for k, v in headers.items() if before.get(k) != v})
        remove = []
        want_body = False
        if reverse is not None:
            remove.append("content-length")  # the rewritten body has another length
            if self.resp_mode == NONE:  # BUFFERED request mode: ask for this response's body
                want_body = True
                self.resp_mode = FULL_DUPLEX_STREAMED
        return [replies.response_headers_reply(set_headers, remove, want_body=want_body)]

    def on_response_body(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        msg = req.response_body
        chunk, eos = msg.body, msg.end_of_stream
        self._observe_body(chunk, eos)
        if self.resp_mode == FULL_DUPLEX_STREAMED:
            if self.resp_streaming:
                return replies.streamed_body_replies(self._rewrite_chunk(chunk), eos, response=True)
            self.resp_buffer.append(chunk)
            if not eos:
                return []
            return replies.streamed_body_replies(self._rewrite_whole(), True, response=True)
        if self.resp_mode == BUFFERED:
            rewritten = self._rewrite_whole_bytes(chunk)
            return [replies.response_body_reply(rewritten if rewritten != chunk else None)]
        rewritten = self._rewrite_chunk(chunk)  # STREAMED: one reply per chunk
        return [replies.response_body_reply(rewritten if rewritten != chunk else None)]

    def on_response_trailers(self) -> list[ep.ProcessingResponse]:
        out = []
        if self.resp_mode == FULL_DUPLEX_STREAMED and not self.resp_streaming and self.resp_buffer:
            out.extend(replies.streamed_body_replies(self._rewrite_whole(), False, response=True))
        out.append(replies.response_trailers_reply())
        return out

    def _observe_body(self, chunk: bytes, eos: bool) -> None:
        if not self.opts.response_body or self.routing is None or self.routing.request is None:
            return
        response = self.response or ResponseInfo()
        response.end_of_stream = eos
        endpoint = self.routing.endpoints[0] if self.routing.endpoints else None
        for plugin in self.opts.response_body:
            plugin.response_body(self.routing.request, response, endpoint, chunk)

    def _rewrite_whole(self) -> bytes:
        body = b"".join(self.resp_buffer)
        self.resp_buffer = []
        return self._rewrite_whole_bytes(body)

    def _rewrite_whole_bytes(self, body: bytes) -> bytes:
        """Non-streaming response: JSON-aware reverse model rewrite (the ``model`` field only)."""
        reverse = self.reverse
        if reverse is None or not body:
            return body
        return replace_existing_model(body, reverse[0])

    def _rewrite_chunk(self, chunk: bytes) -> bytes:
        """Streaming response: replace ``"model":"<target>"`` per chunk (both common spacings)."""
        reverse = self.reverse
        if reverse is None:
            return chunk
        if self.model_pairs is None:  # computed once per stream
            self.model_pairs = model_literal_pairs(reverse[1], reverse[0])
        for old, new in self.model_pairs:
            chunk = chunk.replace(old, new)
        return chunk

    # --- end ---------------------------------------------------------------------------------

    def finish(self) -> None:
        routing = self.routing
        request = routing.request if routing is not None else None
        if self.error is not None:
            model = request.incoming_model if request else ""
            target = request.target_model if request else ""
            metrics.REQUEST_ERROR_TOTAL.labels(model, target, self.error.code.text).inc()
        if routing is None or not self.started:
            return
        self.started = False
        self.director.finish(routing)
        if request is not None:
            metrics.RUNNING_REQUESTS.labels(request.incoming_model).dec()
            metrics.REQUEST_DURATION.labels(request.incoming_model, request.target_model).observe(
                time.monotonic() - self.t_received
            )


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor``: a read/write loop per stream."""

    def __init__(self, director: Director, opts: StreamOptions | None = None) -> None:
        self.director = director
        self.opts = opts or StreamOptions()

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        stream = _Stream(self.director, self.opts)
        read, write = context.read, context.write
        try:
            while True:
                req = await read()
                if req is grpc.aio.EOF:
                    return
                if req.HasField("metadata_context"):
                    _merge_metadata(stream.metadata, req)
                which = req.WhichOneof("request")
                try:
                    if which == "request_body":
                        out = await stream.on_request_body(req)
                    elif which == "request_headers":
                        out = stream.on_request_headers(req)
                    elif which == "response_headers":
                        out = stream.on_response_headers(req)
                    elif which == "response_body":
                        out = stream.on_response_body(req)
                    elif which == "request_trailers":
                        out = await stream.on_request_trailers()
                    elif which == "response_trailers":
                        out = stream.on_response_trailers()
                    else:
                        out = []
                except InferenceError as err:
                    stream.error = err
                    log.info(
                        "request rejected",
                        status=err.code.http_status,
                        error=str(err),
                        request_id=stream.headers.get(REQUEST_ID_HEADER),
                    )
                    await write(replies.immediate_error(err))
                    return
                for resp in out:
                    await write(resp)
        except Exception as e:
            stream.error = stream.error or InferenceError(ErrorCode.INTERNAL, str(e))
            log.exception("ext_proc stream failed", request_id=stream.headers.get(REQUEST_ID_HEADER))
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed to handle request: {e}")
        finally:
            stream.finish()
