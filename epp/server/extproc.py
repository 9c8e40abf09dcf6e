"""The ext_proc stream handler: one gRPC stream per HTTP request.

A stream moves through explicit phases (``Phase``) and is routed at most once; how each Envoy
body mode is answered is described in docs/deploy.md ("The Envoy exchange").
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
import uuid
from collections.abc import Iterable
from typing import Any

import grpc
import structlog
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf.message import DecodeError

from epp import labels, metrics, tracing
from epp.framework import (
    ErrorCode,
    InferenceError,
    LLMRequest,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    ResponseInfo,
)
from epp.framework.errors import DroppedReason, dropped
from epp.framework.wire import (
    DEBUG_RESPONSE_HEADER,
    DESTINATION_HEADER,
    FALLBACK_HEADER,
    LB_NAMESPACE,
    MODEL_REWRITE_HEADERS,
    REQUEST_ID_HEADER,
)
from epp.log_limit import LOGS
from epp.server import body_message, h2grpc, replies
from epp.server.body_message import BodyMessage
from epp.server.body_rewrite import model_literal_pairs, replace_existing_model
from epp.server.decisions import METADATA_KEY as DECISION_KEY
from epp.server.decisions import RESPONSE_HEADER as DECISION_HEADER
from epp.server.director import EPP_OWNED_HEADERS, Director, Routing
from epp.server.pool_metrics import POOL_REQUEST_ERROR_TOTAL, POOL_REQUEST_TOTAL
from epp.server.pools import PoolRegistry, route_pool
from epp.server.stream_limits import RequestPhaseLimits
from epp.server.usage import UsageReader

log = structlog.get_logger("epp.extproc")

# ProcessingMode.BodySendMode values, bound once as module names for the per-message comparisons.
NONE: int = pm.ProcessingMode.NONE
STREAMED: int = pm.ProcessingMode.STREAMED
BUFFERED: int = pm.ProcessingMode.BUFFERED
BUFFERED_PARTIAL: int = pm.ProcessingMode.BUFFERED_PARTIAL
FULL_DUPLEX_STREAMED: int = pm.ProcessingMode.FULL_DUPLEX_STREAMED

_NEVER_ECHO = frozenset({"content-length", DESTINATION_HEADER})


class StreamOptions:
    """Server-wide knobs of the stream handler."""

    __slots__ = (
        "debug_response_header",
        "decision_header",
        "decision_metadata",
        "emit_endpoint_scores",
        "grpc_stream_metrics",
        "max_body_bytes",
        "max_buffered_body_bytes",
        "request_idle_timeout",
        "response_body",
        "response_header",
        "skip_unused_response_phases",
    )

    def __init__(
        self,
        max_body_bytes: int = 10 << 20,
        debug_response_header: bool = True,
        response_header: tuple[ResponseHeaderProcessor, ...] = (),
        response_body: tuple[ResponseBodyProcessor, ...] = (),
        *,
        request_idle_timeout: float = 60.0,
        max_buffered_body_bytes: int = 256 << 20,
        emit_endpoint_scores: bool = False,
        grpc_stream_metrics: bool = False,
        skip_unused_response_phases: bool = False,
        decision_metadata: bool = False,
        decision_header: bool = False,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.decision_metadata = decision_metadata  # epp.decision dynamic metadata in the routing reply
        self.decision_header = decision_header  # x-epp-decision on the response (an operator's choice)
        self.debug_response_header = debug_response_header
        self.response_header = response_header
        self.response_body = response_body
        self.request_idle_timeout = request_idle_timeout  # 0: no idle timeout
        self.max_buffered_body_bytes = max_buffered_body_bytes  # 0: no budget
        self.emit_endpoint_scores = emit_endpoint_scores  # envoy.lb x-gateway-destination-endpoint-scores
        self.grpc_stream_metrics = grpc_stream_metrics  # stream duration and completion-code metrics
        # BUFFERED: turn the response phases off per request (mode_override) when nothing reads them
        self.skip_unused_response_phases = (
            skip_unused_response_phases and not response_header and not response_body and not decision_header
        )


class Phase(enum.Enum):
    """Where a stream is; the value describes it (in protocol-error messages)."""

    HEADERS = "waiting for the request headers"
    BODY = "reading the request body"
    TRAILERS = "routed, waiting for the request trailers"
    ROUTED = "routed, the request ended"
    EXPIRED = "cut by the request idle timeout"
    DONE = "ended"


HEADERS, BODY, TRAILERS, ROUTED, EXPIRED, DONE = Phase
_HOLDING = frozenset({HEADERS, BODY, EXPIRED})  # watched by the idle timeout, body bytes reserved


def _budget_exceeded(budget: int) -> InferenceError:
    return InferenceError(
        ErrorCode.SERVICE_UNAVAILABLE,
        f"the EPP holds too many partial request bodies (over {budget} bytes across all requests, "
        "--max-buffered-request-body-bytes); retry later",
        headers={"retry-after": "1"},
    )


def _evicted() -> InferenceError:
    """The 429 of a request revoked by flow control's eviction (a new error each time: a raised
    exception keeps its traceback)."""
    return dropped(
        ErrorCode.RESOURCE_EXHAUSTED,
        "request evicted by flow control: capacity reclaimed for higher-priority requests",
        DroppedReason.EVICTED,
    )


class _ProtocolError(Exception):
    """A request message the stream's phase does not expect: the stream ends with FAILED_PRECONDITION."""

    def __init__(self, message: str, phase: Phase) -> None:
        super().__init__(f"unexpected {message} ext_proc message: the stream is {phase.value}")


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        raw = h.raw_value  # what Envoy sends; ``value`` only from older senders
        out[h.key] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def _scan_response_headers(msg: ep.HttpHeaders) -> tuple[bool, int, int]:
    """(content-type is SSE, content-length or -1, :status or 0), without building the header map."""
    sse, length, status = False, -1, 0
    for h in msg.headers.headers:
        key = h.key
        if key == ":status":
            raw = h.raw_value or h.value.encode()
            status = int(raw) if raw.isdigit() else 0
        elif key == "content-type":
            sse = b"text/event-stream" in h.raw_value or "text/event-stream" in h.value
        elif key == "content-length":
            raw = h.raw_value or h.value.encode()
            length = int(raw) if raw.isdigit() else -1
    return sse, length, status


# ``error_code`` of a failed response that reached the client from upstream (an engine's error
# status, or Envoy's own reply when the engine reset, refused or timed out): the code of the same
# HTTP status where the reference has one.
_STATUS_ERROR_CODES = {code.http_status: code.text for code in ErrorCode}
_STATUS_ERROR_CODES[504] = "DeadlineExceeded"


def upstream_error_code(status: int) -> str | None:
    """The ``error_code`` a response status counts under, ``None`` for a success (below 400)."""
    if status < 400:
        return None
    return _STATUS_ERROR_CODES.get(status) or ("ModelServerError" if status >= 500 else "BadRequest")


_STREAMS_OPEN = metrics.EXTPROC_STREAMS_INFLIGHT.labels()
_REJECTED_IDLE = metrics.EXTPROC_STREAMS_REJECTED.labels("idle_timeout")
_REJECTED_BUDGET = metrics.EXTPROC_STREAMS_REJECTED.labels("body_budget")
_REJECTED_PROTOCOL = metrics.EXTPROC_STREAMS_REJECTED.labels("protocol_error")
_REQUEST_PROCESSING = metrics.REQUEST_PROCESSING.labels()
_RESPONSE_PROCESSING = metrics.RESPONSE_PROCESSING.labels()
_STREAM_DURATION = metrics.EXTPROC_STREAM_DURATION.labels()


def _error_key(error: InferenceError, pool: str) -> metrics.RequestKey:
    """The labels of a request rejected before it was built: the model its body named, if any."""
    model = error.model
    if not model:
        return metrics.no_key(pool)
    bound = labels.MODEL_NAMES.bound(model)
    return (bound, bound, "", "", pool)


# Replies that never change, built once.
_RESPONSE_HEADERS_DEBUG = replies.response_headers_reply({DEBUG_RESPONSE_HEADER: "true"})
_RESPONSE_HEADERS_PLAIN = replies.response_headers_reply({})
_CONTINUE_REQUEST_HEADERS = replies.request_headers_reply()
_CONTINUE_WITHOUT_RESPONSE = replies.request_headers_reply(mode_override=replies.NO_RESPONSE_PHASES)


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
    """Merge (not replace) the request's filter metadata into ``into``."""
    for ns, st in req.metadata_context.filter_metadata.items():
        into.setdefault(ns, {}).update({k: _struct_value(v) for k, v in st.fields.items()})


class _Stream:
    """State of one ext_proc stream (one HTTP request)."""

    __slots__ = (
        "body_size",
        "chunks",
        "director",
        "error",
        "headers",
        "last_seen",
        "limits",
        "metadata",
        "mkey",
        "model_pairs",
        "opts",
        "override",
        "pending",
        "phase",
        "pool_label",
        "req_mode",
        "request",
        "request_id_generated",
        "reserved",
        "resp_buffer",
        "resp_cpu",
        "resp_eos",
        "resp_error",
        "resp_length",
        "resp_mode",
        "resp_size",
        "resp_streaming",
        "response",
        "reverse",
        "revoked",
        "routing",
        "span",
        "t_first",
        "t_last",
        "t_received",
        "t_resp",
        "task",
        "usage",
        "writer",
    )

    def __init__(
        self, director: Director, opts: StreamOptions, limits: RequestPhaseLimits | None = None
    ) -> None:
        self.director = director
        self.opts = opts
        self.limits = limits or RequestPhaseLimits(0, 0)
        self.phase = HEADERS
        self.task: asyncio.Task[Any] | None = None  # the handler's task, cut by the idle timeout
        self.last_seen = time.monotonic()
        self.req_mode = FULL_DUPLEX_STREAMED
        self.resp_mode = FULL_DUPLEX_STREAMED
        self.headers: dict[str, str] = {}
        self.metadata: dict[str, dict[str, Any]] = {}
        self.chunks: list[bytes] = []
        self.pending = 0  # STREAMED: body chunks received and not answered yet (one reply each)
        self.body_size = 0  # request-body bytes received
        self.reserved = 0  # of which held in the global budget while waiting for the rest
        self.routing: Routing | None = None  # set exactly when in-flight accounting began
        self.error: InferenceError | None = None
        self.request_id_generated = False
        self.resp_streaming = False
        self.resp_buffer: list[bytes] = []
        self.response: ResponseInfo | None = None
        self.t_received = 0.0
        self.model_pairs: tuple[tuple[bytes, bytes], ...] | None = None
        self.reverse: tuple[str, str] | None = None  # (incoming, target) to undo in the response body
        self.span: Any = None  # the request's trace span (--tracing)
        # Metrics: the request's bound labels (set when routed), the parsed request (also when
        # rejected), the response as far as the EPP sees it.
        self.mkey: metrics.RequestKey | None = None
        self.pool_label = director.pool_label  # the inference_pool label ("": no pool matched yet)
        self.request: LLMRequest | None = None
        self.resp_cpu = 0.0  # EPP time spent on response messages
        self.t_resp = 0.0  # perf_counter at the response headers
        self.resp_length = -1  # content-length of the response headers
        self.resp_size = 0  # response-body bytes seen
        self.resp_eos = False  # the response body's end was seen
        self.resp_error: str | None = None  # error_code of a failed response status (counted at the end)
        self.t_first = 0.0  # monotonic time of the first / latest response-body chunk
        self.t_last = 0.0
        self.usage: UsageReader | None = None
        # BUFFERED mode while flow control holds the request: the write extending Envoy's timer
        self.writer: Any = None
        self.override: asyncio.Future[Any] | None = None
        self.revoked = False  # flow control evicted this in-flight request

    # --- request path ------------------------------------------------------------------------

    def on_request_headers(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if self.phase is not HEADERS:
            raise _ProtocolError("request_headers", self.phase)
        if req.HasField("protocol_config"):
            pc = req.protocol_config
            self.req_mode = pc.request_body_mode
            self.resp_mode = pc.response_body_mode
        self.t_received = self.last_seen = time.monotonic()
        msg = req.request_headers
        headers = self.headers = _headers(msg)
        if not headers.get(REQUEST_ID_HEADER):
            headers[REQUEST_ID_HEADER] = str(uuid.uuid4())
            self.request_id_generated = True
        tracer = tracing.TRACER
        if tracer is not None:
            self.span = tracing.start_request(tracer, headers)
        if msg.end_of_stream or self.req_mode == NONE:
            if msg.end_of_stream and self.director.hooks.responders:
                answer = self.director.respond(headers)  # e.g. GET /v1/models, from the data layer
                if answer is not None:
                    self._end_request_phase(DONE)
                    return [replies.immediate_local(answer)]
            # No body will come (trailers may, in mode NONE): a random candidate, answered now.
            self._end_request_phase(ROUTED if msg.end_of_stream else TRAILERS)
            routing = self.director.route_random(self.metadata)
            return [self._routing_reply(routing, content_length=False, on_headers=True)]
        if self.req_mode == BUFFERED_PARTIAL or (
            self.req_mode == STREAMED
            and not req.protocol_config.send_body_without_waiting_for_header_response
        ):
            raise InferenceError(
                ErrorCode.INTERNAL,
                "unsupported ext_proc request_body_mode: use FULL_DUPLEX_STREAMED, BUFFERED or STREAMED with "
                "send_body_without_waiting_for_header_response",
            )
        self.phase = BODY
        if self.req_mode == BUFFERED:
            if self.opts.skip_unused_response_phases and not self._may_rewrite(headers):
                self.resp_mode = NONE
                return [_CONTINUE_WITHOUT_RESPONSE]
            return [_CONTINUE_REQUEST_HEADERS]
        return []

    def _may_rewrite(self, headers: dict[str, str]) -> bool:
        """Whether this request's model may be rewritten (its response body is then needed)."""
        director = self.director
        return director.rewrites is not None or (
            director.client_model_rewrite and any(h in headers for h in MODEL_REWRITE_HEADERS)
        )

    async def on_request_body(self, req: ep.ProcessingRequest) -> Iterable[ep.ProcessingResponse]:
        msg = req.request_body
        return await self.on_request_chunk(msg.body, msg.end_of_stream)

    async def on_request_chunk(self, chunk: bytes, eos: bool) -> Iterable[ep.ProcessingResponse]:
        """A request body message (its bytes; the caller keeps no copy of the message meanwhile)."""
        if self.phase is not BODY:
            raise _ProtocolError("request_body", self.phase)
        if chunk:
            size = self.body_size + len(chunk)
            if size > self.opts.max_body_bytes:
                raise InferenceError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"request body exceeds {self.opts.max_body_bytes} bytes (--max-request-body-bytes)",
                )
            self.body_size = size
            self.chunks.append(chunk)
        if self.req_mode == STREAMED:
            self.pending += 1  # every body message is answered, after the routing headers reply
        if eos:
            return await self._route_body(trailers=False)
        if self.req_mode == BUFFERED:  # the whole body; the request trailers follow
            return await self._route_body(trailers=True, then=TRAILERS)
        if chunk:  # held until the rest of the body comes: counted in the global budget
            if not self.limits.reserve(len(chunk)):
                _REJECTED_BUDGET.inc()
                raise _budget_exceeded(self.limits.budget)
            self.reserved += len(chunk)
        self.last_seen = time.monotonic()
        return []

    async def on_request_trailers(self) -> Iterable[ep.ProcessingResponse]:
        # The reference ignores request trailers and hangs: here they end the body.
        phase = self.phase
        if phase is TRAILERS:  # routed on the body (BUFFERED) or the headers (mode NONE)
            self.phase = ROUTED
            return [replies.request_trailers_reply()]
        if phase is not BODY:
            raise _ProtocolError("request_trailers", phase)
        out = await self._route_body(trailers=True)
        return itertools.chain(out, (replies.request_trailers_reply(),))

    def _end_request_phase(self, phase: Phase) -> None:
        """The request was read (routing follows): the idle timeout and the budget let go of it."""
        self.phase = phase
        limits = self.limits
        limits.unwatch(self)
        if self.reserved:
            limits.release(self.reserved)
            self.reserved = 0

    def revoke(self) -> None:
        """Flow control evicts this in-flight request: cut the handler, which answers 429."""
        if self.phase is not DONE and self.task is not None and not self.revoked:
            self.revoked = True
            self.task.cancel()

    def expire(self) -> None:
        """The idle timeout elapsed (called by the sweeper): cut the handler's task."""
        if self.phase in _HOLDING and self.task is not None:
            self.phase = EXPIRED
            self.task.cancel()

    async def _route_body(self, trailers: bool, then: Phase = ROUTED) -> Iterable[ep.ProcessingResponse]:
        """Route the complete body; one copy of it is held (the chunks are let go once joined) and
        the FULL_DUPLEX_STREAMED echo is built piece by piece as the replies are written."""
        self._end_request_phase(then)
        chunks, self.chunks = self.chunks, []
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        if self.span is None:
            routing = await self.director.route(
                dict(self.headers), raw, self.metadata, self._note_request, self._on_queued
            )
        else:
            routing = await self._route_traced(raw)
        if self.req_mode == BUFFERED:
            return [self._routing_reply(routing, content_length=routing.body_changed)]
        if self.req_mode == STREAMED:  # the delayed headers reply, then one reply per body chunk
            out = [self._routing_reply(routing, content_length=routing.body_changed)]
            out.extend(replies.chunk_replies(self.pending, routing.body if routing.body_changed else None))
            self.pending = 0
            return out
        head = self._routing_reply(routing, content_length=True)
        return itertools.chain(
            (head,), replies.streamed_body_pieces(routing.body, end_of_stream=not trailers)
        )

    async def _route_traced(self, raw: bytes) -> Routing:
        tracer = tracing.TRACER
        if tracer is None:  # turned off meanwhile (shutdown)
            return await self.director.route(
                dict(self.headers), raw, self.metadata, self._note_request, self._on_queued
            )
        span, token = tracing.start_orchestration(tracer, self.span)
        routing: Routing | None = None
        error: BaseException | None = None
        try:
            routing = await self.director.route(
                dict(self.headers), raw, self.metadata, self._note_request, self._on_queued
            )
            return routing
        except BaseException as e:
            error = e
            raise
        finally:
            tracing.end_orchestration(span, token, routing.request if routing else None, error)

    def _routing_reply(
        self, routing: Routing, content_length: bool, on_headers: bool = False
    ) -> ep.ProcessingResponse:
        """The reply that routes: destination header and metadata, header changes, removals.

        In-flight accounting begins here, before anything else can fail, so ``finish`` releases it.
        """
        self._begin(routing)
        set_headers: dict[str, str] = {}
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
        if FALLBACK_HEADER in client and not routing.fallback:  # a client's copy never steers a retry
            remove.append(FALLBACK_HEADER)
        scores = self.opts.emit_endpoint_scores and routing.result is not None
        decision = routing.decision if self.opts.decision_metadata else None
        rewritten = routing.model_changed and request is not None
        reply = replies.routing_reply(
            routing.destination,
            on_body=self.req_mode == BUFFERED and not on_headers,
            set_headers=set_headers,
            remove=remove,
            body=routing.body if self.req_mode == BUFFERED and routing.body_changed else None,
            private=scores or rewritten or decision is not None,
            fallback=routing.fallback,
        )
        if decision is not None:
            replies.add_dynamic_metadata(reply, {LB_NAMESPACE: {DECISION_KEY: decision.metadata()}})
        if rewritten:
            assert request is not None
            replies.add_rewrite_metadata(reply, request.incoming_model, request.target_model)
        if scores:
            assert routing.result is not None
            primary = routing.result.primary
            if primary is not None and primary.scores:
                hostports = [e.hostport for e in primary.target_endpoints]
                replies.add_endpoint_scores(reply, dict(zip(hostports, primary.scores, strict=False)))
        _REQUEST_PROCESSING.observe(time.monotonic() - self.t_received)
        return reply

    def _note_request(self, request: LLMRequest) -> None:
        self.request = request

    def _on_queued(self) -> None:
        """Flow control holds the request: in BUFFERED and STREAMED mode Envoy's per-message timer runs
        meanwhile, so extend it to the queue's budget (FULL_DUPLEX_STREAMED has no such timer)."""
        if self.req_mode == FULL_DUPLEX_STREAMED or self.writer is None or self.override is not None:
            return
        fc = self.director.flow_control
        budget = fc.wait_budget if fc is not None else 0.0
        self.override = asyncio.ensure_future(self.writer(replies.message_timeout_override(budget)))

    def _begin(self, routing: Routing) -> None:
        """Count the request as in flight (endpoints, running-requests gauge): once per stream."""
        if self.routing is not None:
            raise RuntimeError("ext_proc stream routed twice")
        self.routing = routing
        self.director.track_in_flight(routing, self.revoke)
        r = routing.request
        if r is not None:
            # Whether the response will be a stream, from the request until the response headers
            # tell (they may not come: response_header_mode SKIP).
            self.resp_streaming = r.stream
            key = self.mkey = metrics.request_key(
                r.incoming_model, r.target_model, r.fairness_id, r.priority, self.pool_label
            )
            metrics.REQUEST_TOTAL.at(key).inc()
            metrics.seed_errors(key)
            metrics.REQUEST_SIZES.at(key).observe(len(routing.body))
            metrics.RUNNING_REQUESTS.at(key).inc()

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
        if not routing.model_changed or request is None:
            return None
        if self.resp_mode == NONE and self.req_mode != BUFFERED:
            return None
        return request.incoming_model, request.target_model

    def on_response_headers(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        t0 = self.t_resp = time.perf_counter()
        out = self._response_headers(req)
        self.resp_cpu += time.perf_counter() - t0
        return out

    def _response_headers(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        opts, routing = self.opts, self.routing
        reverse = self.reverse = self._reverse_models()
        if (
            not opts.response_header
            and not opts.response_body
            and reverse is None
            and not opts.decision_header
        ):
            # Nothing looks at the response: only note whether its body will be an event stream.
            request = routing.request if routing is not None else None
            sse, self.resp_length, code = _scan_response_headers(req.response_headers)
            self.resp_streaming = bool(request is not None and request.stream) or sse
            if code >= 400:
                self.resp_error = upstream_error_code(code)
            if self.span is not None:
                tracing.response_status(self.span, _headers(req.response_headers).get(":status", ""))
            return [_RESPONSE_HEADERS_DEBUG if opts.debug_response_header else _RESPONSE_HEADERS_PLAIN]
        headers = _headers(req.response_headers)
        length = headers.get("content-length", "")
        self.resp_length = int(length) if length.isdigit() else -1
        status = headers.get(":status") or headers.get("status") or "0"
        self.response = response = ResponseInfo(
            headers=headers, status=int(status) if status.isdigit() else 0
        )
        if response.status >= 400:
            self.resp_error = upstream_error_code(response.status)
        if self.span is not None:
            tracing.response_status(self.span, status)
        request = routing.request if routing is not None else None
        self.resp_streaming = bool(
            (request is not None and request.stream) or "text/event-stream" in headers.get("content-type", "")
        )
        set_headers: dict[str, str] = {}
        if self.opts.debug_response_header:
            set_headers[DEBUG_RESPONSE_HEADER] = "true"
        if opts.decision_header and routing is not None and routing.decision is not None:
            set_headers[DECISION_HEADER] = routing.decision.summary()
        if self.opts.response_header and request is not None:
            before = dict(headers)
            endpoint = routing.endpoints[0] if routing and routing.endpoints else None
            for plugin in self.opts.response_header:
                t0 = time.perf_counter()
                plugin.response_header(request, response, endpoint)
                metrics.observe_plugin("ResponseReceived", plugin, time.perf_counter() - t0)
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
        t0 = time.perf_counter()
        out = self._response_body(req)
        now = time.perf_counter()
        if self.resp_eos and self._holds_body() and self.t_resp:
            self.resp_cpu = now - self.t_resp  # the whole body was held here since the headers
        else:
            self.resp_cpu += now - t0
        return out

    def _response_body(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        msg = req.response_body
        chunk, eos = msg.body, msg.end_of_stream
        self._observe_body(chunk, eos)
        out = self._response_body_replies(chunk, eos)
        if eos:
            self._attach_metadata(out)
        return out

    def _holds_body(self) -> bool:
        """Whether the response body is held until its end: a full-duplex non-streamed body whose
        model this stream undoes (a JSON-aware rewrite of the whole body). Every other body's chunks
        are answered as they come, so a stream's first token is never held back."""
        return self.resp_mode == FULL_DUPLEX_STREAMED and not self.resp_streaming and self.reverse is not None

    def _response_body_replies(self, chunk: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        if self.resp_mode == FULL_DUPLEX_STREAMED:
            if not self._holds_body():
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
        t0 = time.perf_counter()
        out = self._response_trailers()
        self.resp_cpu += time.perf_counter() - t0
        return out

    def _response_trailers(self) -> list[ep.ProcessingResponse]:
        if self.resp_mode != NONE and not self.resp_eos:  # the body ended with the trailers
            self._observe_body(b"", True)
        out = []
        if self._holds_body() and self.resp_buffer:
            out.extend(replies.streamed_body_replies(self._rewrite_whole(), False, response=True))
        out.append(replies.response_trailers_reply())
        self._attach_metadata(out)
        return out

    def _attach_metadata(self, out: list[ep.ProcessingResponse]) -> None:
        """Response-body plugins' dynamic metadata rides on the reply that ends the response."""
        response = self.response
        if response is not None and response.dynamic_metadata and out:
            replies.add_dynamic_metadata(out[-1], response.dynamic_metadata)
            response.dynamic_metadata = None

    def _observe_body(self, chunk: bytes, eos: bool) -> None:
        """Response-body metrics (size, TTFT, inter-token latency, usage) and the body plugins."""
        key = self.mkey
        if key is None or self.resp_eos:  # not a routed request (a response-rewrite stream), or done
            return
        now = time.monotonic()
        if chunk:
            self.resp_size += len(chunk)
            if self.resp_streaming and self.t_last:
                metrics.ITL.at(key).observe(now - self.t_last)
            if not self.t_first:
                self.t_first = now
            self.t_last = now
            usage = self.usage
            if usage is None:
                usage = self.usage = UsageReader()
            usage.feed(chunk)
        if eos:
            self.resp_eos = True
            self._record_response_end(key, now)
        request = self.routing.request if self.routing is not None else None
        if not self.opts.response_body or request is None:
            return
        response = self.response
        if response is None:
            response = self.response = ResponseInfo()
        if response.end_of_stream:
            return  # the end was already seen (a body end_of_stream, then trailers)
        if self.usage is not None:
            response.usage = self.usage.usage
        response.end_of_stream = eos
        endpoint = self.routing.endpoints[0] if self.routing and self.routing.endpoints else None
        point = "ResponseComplete" if eos else "ResponseStreaming"
        for plugin in self.opts.response_body:
            t0 = time.perf_counter()
            plugin.response_body(request, response, endpoint, chunk)
            metrics.observe_plugin(point, plugin, time.perf_counter() - t0)

    def _record_response_end(self, key: metrics.RequestKey, now: float) -> None:
        """The response body ended: token counts, TTFT, TPOT and NTPOT as the reference derives them."""
        usage = self.usage
        completion = usage.completion if usage is not None else 0
        if usage is not None:
            if usage.prompt:
                metrics.INPUT_TOKENS.at(key).observe(usage.prompt)
            if completion:
                metrics.OUTPUT_TOKENS.at(key).observe(completion)
            if usage.raw is not None and isinstance(usage.raw.get("prompt_tokens_details"), dict):
                metrics.CACHED_TOKENS.at(key).observe(usage.cached)
        e2e = now - self.t_received
        if completion > 0 and e2e > 0:
            metrics.NTPOT.at(key).observe(e2e / completion)
        first = self.t_first
        if first:
            streaming = self.resp_streaming
            metrics.TTFT.at((*key, "true" if streaming else "false")).observe(first - self.t_received)
            if streaming and completion > 1 and now > first:
                metrics.TPOT.at(key).observe((now - first) / (completion - 1))

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

    async def flush_override(self) -> None:
        """Wait for the timer-extending write (if any) so that replies never interleave with it."""
        pending = self.override
        if pending is not None:
            self.override = None
            try:
                await pending
            except Exception:  # the stream broke: the next write reports it
                pass

    def finish(self) -> None:
        """The stream ended, however: release everything it holds, exactly once."""
        phase = self.phase
        if phase is DONE:
            return
        self.phase = DONE
        if self.override is not None and not self.override.done():
            self.override.cancel()
        if phase in _HOLDING:
            self._end_request_phase(DONE)
            self.chunks = []
        routing = self.routing
        request = routing.request if routing is not None else self.request
        span = self.span
        if span is not None:
            self.span = None
            error = self.error
            tracing.end_request(
                span,
                request,
                routing.destination if routing is not None else "",
                str(error) if error is not None else None,
            )
        key = self.mkey
        if self.error is not None:
            r = self.request
            if key is None and r is not None:
                key = metrics.request_key(
                    r.incoming_model, r.target_model, r.fairness_id, r.priority, self.pool_label
                )
            if key is None:
                key = _error_key(self.error, self.pool_label)
            metrics.REQUEST_ERROR_TOTAL.at((*key, self.error.code.text)).inc()
        elif self.resp_error is not None and key is not None:
            metrics.REQUEST_ERROR_TOTAL.at((*key, self.resp_error)).inc()
        if routing is None:  # also a response-rewrite stream: its request is counted by its routing stream
            return
        if self.resp_cpu > 0.0:
            _RESPONSE_PROCESSING.observe(self.resp_cpu)
        self.director.release_in_flight(routing)
        if self.error is not None or (self.response is not None and self.response.status >= 500):
            for e in routing.endpoints:
                self.director.activity.error(e.hostport)
        if key is not None and routing.request is not None:
            metrics.RUNNING_REQUESTS.at(key).dec()
            metrics.REQUEST_DURATION.at(key).observe(time.monotonic() - self.t_received)
            size = self.resp_size if self.resp_eos else self.resp_length
            if size >= 0 and (self.resp_eos or self.t_resp):
                metrics.RESPONSE_SIZES.at(key).observe(size)


def add_to_server(processor: ExternalProcessor, server: grpc.aio.Server | h2grpc.Server) -> None:
    """Serve ``processor`` as ``envoy.service.ext_proc.v3.ExternalProcessor``; request messages are
    decoded by ``body_message.decode`` (long bodies are not copied through protobuf; on epp's own
    server a message received in pieces is read in place)."""
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            processor.Process,
            request_deserializer=body_message.decode,
            response_serializer=ep.ProcessingResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)
    if isinstance(server, h2grpc.Server):
        server.add_piece_decoder(f"/{_SERVICE}/Process", body_message.decode_pieces)


_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor``: a read/write loop per stream.

    FULL_DUPLEX_STREAMED: the body is buffered until ``end_of_stream`` (or trailers), then the routing
    headers reply and the body re-sent in ``streamed_response`` pieces. BUFFERED: an empty headers
    reply, then a body reply carrying the routing. Failures become an ``ImmediateResponse``; however the
    stream ends, in-flight accounting is released.
    """

    def __init__(
        self, director: Director, opts: StreamOptions | None = None, *, pools: PoolRegistry | None = None
    ) -> None:
        """``pools``: with several pools, each stream's director is its pool's (``PoolRegistry.select``)."""
        self.director = director
        self.pools = pools
        self.opts = opts = opts or StreamOptions()
        self.limits = RequestPhaseLimits(
            opts.request_idle_timeout, opts.max_buffered_body_bytes, metrics.EXTPROC_BUFFERED_BYTES.labels()
        )

    async def close(self) -> None:
        """Stop the idle-timeout sweeper (after the gRPC server stopped)."""
        await self.limits.close()

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        limits = self.limits
        stream = _Stream(self.director, self.opts, limits)
        limits.watch(stream)
        _STREAMS_OPEN.inc()
        t_open = time.monotonic()
        code = "OK"
        read, write = context.read, context.write
        stream.writer = write
        pools = self.pools
        if pools is not None and not pools.multi:
            pools = None  # one pool: every stream is its director's
        elif pools is not None:
            stream.pool_label = ""  # until the request's pool is known
        pool_name = ""
        try:
            while True:
                req = await read()
                if req is grpc.aio.EOF:
                    return
                if type(req) is BodyMessage:  # a long body, sliced off the wire
                    fields, which = req.rest, "request_body"
                else:
                    fields, which = req, req.WhichOneof("request")
                if fields.HasField("metadata_context"):
                    _merge_metadata(stream.metadata, fields)
                try:
                    if which == "request_body":  # the message is let go while the body is routed
                        if type(req) is BodyMessage:
                            chunk, eos = req.body, req.end_of_stream
                        else:
                            body = req.request_body
                            chunk, eos = body.body, body.end_of_stream
                            del body
                        del req, fields
                        out = await stream.on_request_chunk(chunk, eos)
                        del chunk
                    elif which == "request_headers":
                        if pools is not None:
                            named = route_pool(context.invocation_metadata() or ())
                            pool = pools.select(named, stream.metadata)
                            stream.director, pool_name = pool.director, pool.name
                            stream.pool_label = pool.director.pool_label
                            POOL_REQUEST_TOTAL.labels(pool_name).inc()
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
                    if pools is not None:
                        POOL_REQUEST_ERROR_TOTAL.labels(pool_name, err.code.text).inc()
                    if stream.routing is None:  # the request phase ended here
                        _REQUEST_PROCESSING.observe(time.monotonic() - stream.t_received)
                    LOGS.log(
                        log.info,
                        f"rejected_{err.code.http_status}",
                        "request rejected",
                        status=err.code.http_status,
                        error=str(err),
                        request_id=stream.headers.get(REQUEST_ID_HEADER),
                    )
                    await stream.flush_override()
                    await write(replies.immediate_error(err))
                    return
                if stream.override is not None:
                    await stream.flush_override()
                for resp in out:
                    await write(resp)
        except _ProtocolError as e:
            _REJECTED_PROTOCOL.inc()
            code = "FailedPrecondition"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except asyncio.CancelledError:
            if stream.revoked and stream.task is not None:
                stream.task.uncancel()
                code = "Evicted"
                stream.error = evicted = _evicted()
                await stream.flush_override()
                await write(replies.immediate_error(evicted))
                return
            if stream.phase is not EXPIRED or stream.task is None:
                code = "Canceled"
                raise  # the client cancelled the stream
            stream.task.uncancel()
            _REJECTED_IDLE.inc()
            code = "DeadlineExceeded"
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request idle timeout: no ext_proc request message for {limits.idle_timeout:g}s "
                "before the request was complete (--request-idle-timeout)",
            )
        except Exception as e:
            code = "Unknown"
            stream.error = stream.error or InferenceError(ErrorCode.INTERNAL, str(e))
            if isinstance(e, DecodeError):  # a malformed frame from the client: no traceback
                LOGS.log(log.warning, "malformed_frame", "malformed ext_proc message", error=str(e))
            else:
                rid = stream.headers.get(REQUEST_ID_HEADER)
                LOGS.log(log.exception, "stream_failed", "ext_proc stream failed", request_id=rid)
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed to handle request: {e}")
        finally:
            stream.finish()
            _STREAMS_OPEN.dec()
            if self.opts.grpc_stream_metrics:
                _STREAM_DURATION.observe(time.monotonic() - t_open)
                metrics.EXTPROC_STREAMS_TOTAL.labels(code).inc()
