"""The OpenAI-compatible HTTP face of the simulated vLLM server (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.dev.sim.engine import (
    Engine,
    EngineSnapshot,
    QueueFullError,
    RequestSpec,
    Sequence,
    SimConfig,
    Token,
)
from epp.dev.sim.latency import Histogram
from epp.dev.sim.tokens import chat_tokens, id_tokens, text_tokens

__all__ = ["SimCluster", "SimConfig", "SimServer", "build_app", "rank_configs"]

log = structlog.get_logger("epp.sim")

JOURNAL_SIZE = 100
MAX_BODY_BYTES = 64 * 1024 * 1024
POD_HEADER = "x-inference-pod"
NAMESPACE_HEADER = "x-inference-namespace"
PORT_HEADER = "x-inference-port"
FORCE_ERROR_HEADER = "x-sim-force-error"
JSON_CONTENT_TYPE = "application/json"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------- errors


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }
        return _json_response(body, status=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "BadRequestError", param)


def _http_error_type(status: int) -> str:
    return {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError"}.get(
        status, "BadRequestError" if status < 500 else "InternalServerError"
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error, the router's 404/405 included, in the OpenAI shape."""
    try:
        return await handler(request)
    except OpenAIError as err:
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return OpenAIError(exc.status, exc.reason, _http_error_type(exc.status)).response()


# --------------------------------------------------------------------------- identity headers


@dataclass(slots=True, frozen=True)
class Identity:
    """Who answers: reported in the ``x-inference-*`` headers."""

    pod: str
    namespace: str
    port: int


def identity_of(request: web.Request) -> Identity:
    """The identity for a request; the port is the one the connection actually arrived on."""
    config = request.app[CONFIG_KEY]
    port = _local_port(request) or config.port
    return Identity(pod=config.pod_name(port), namespace=config.namespace, port=port)


def _local_port(request: web.Request) -> int | None:
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2 and isinstance(sockname[1], int):
        return sockname[1]
    return None


async def add_identity_headers(request: web.Request, response: web.StreamResponse) -> None:
    identity = identity_of(request)
    response.headers[POD_HEADER] = identity.pod
    response.headers[NAMESPACE_HEADER] = identity.namespace
    response.headers[PORT_HEADER] = str(identity.port)


# --------------------------------------------------------------------------- debug journal


@dataclass(slots=True)
class RequestJournal:
    """The last received inference requests, exactly as they arrived."""

    entries: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=JOURNAL_SIZE))

    def record(self, request: web.Request, body: bytes) -> None:
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        text = body.decode("utf-8", errors="replace")
        self.entries.append({"path": request.path_qs, "headers": headers, "body": text})

    def clear(self) -> int:
        count = len(self.entries)
        self.entries.clear()
        return count


CONFIG_KEY = web.AppKey("config", SimConfig)
ENGINE_KEY = web.AppKey("engine", Engine)
JOURNAL_KEY = web.AppKey("journal", RequestJournal)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
CREATED_KEY = web.AppKey("created", int)
RNG_KEY = web.AppKey("rng", random.Random)


# --------------------------------------------------------------------------- request parsing


@dataclass(slots=True, frozen=True)
class InferenceRequest:
    """The parts of an OpenAI completions / chat request the simulator acts on."""

    chat: bool
    model: str
    prompt: tuple[str, ...]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def remote_prefill(self) -> bool:
        """The prompt's KV comes from a remote prefill worker (``do_remote_prefill`` or remote block ids)."""
        params = self.kv_transfer_params or {}
        return params.get("do_remote_prefill") is True or params.get("remote_block_ids") is not None

    @property
    def remote_decode(self) -> bool:
        """A prefill-only request whose KV a remote decode worker will fetch."""
        return (self.kv_transfer_params or {}).get("do_remote_decode") is True


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


def parse_request(body: dict[str, Any], config: SimConfig, *, chat: bool) -> InferenceRequest:
    """Validate the body (400 on bad fields), then the model (404 when not served)."""
    prompt = _chat_prompt(body) if chat else _completion_prompt(body)
    max_tokens = _max_tokens(body, chat=chat)
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = stream and _optional_bool(options or {}, "include_usage", param="stream_options")
    kv_transfer_params = body.get("kv_transfer_params")
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise bad_request("kv_transfer_params must be an object", "kv_transfer_params")
    model = _model(body, config)
    return InferenceRequest(chat, model, prompt, max_tokens, stream, include_usage, kv_transfer_params)


def _model(body: dict[str, Any], config: SimConfig) -> str:
    model = body.get("model")
    if model is None:
        return config.model
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model not in config.model_names and model not in config.lora_modules:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return model


def _completion_prompt(body: dict[str, Any]) -> tuple[str, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tuple(text_tokens(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return tuple(token for item in prompt for token in text_tokens(item))
        if all(_is_int(item) for item in prompt):
            return tuple(id_tokens(prompt))
        if all(isinstance(item, list) and all(_is_int(tok) for tok in item) for item in prompt):
            return tuple(token for item in prompt for token in id_tokens(item))
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    raise bad_request("prompt must be a string, a list of strings or a list of token ids", "prompt")


def _chat_prompt(body: dict[str, Any]) -> tuple[str, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if not all(isinstance(message, dict) for message in messages):
        raise bad_request("every message must be an object", "messages")
    pairs = [(str(message.get("role", "")), _message_text(message.get("content"))) for message in messages]
    return tuple(chat_tokens(pairs))


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _max_tokens(body: dict[str, Any], *, chat: bool) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise bad_request(f"{name} must be a positive integer", name)
        return int(value)
    return None


def _optional_bool(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", param or name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- response bodies


@dataclass(slots=True)
class Completion:
    """The response being produced for one request; builds the OpenAI bodies and SSE chunks."""

    request: InferenceRequest
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    kv_transfer_params: dict[str, Any] | None = None
    """Returned to a prefill request (``do_remote_decode``) so the decoder can fetch the KV."""

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.request.chat else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self.request.chat else "text_completion"

    def usage(self, seq: Sequence) -> dict[str, Any]:
        prompt, completion = seq.spec.prompt_tokens, seq.generated_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
        }

    def full(self, text: str, finish_reason: str | None, seq: Sequence) -> dict[str, Any]:
        """The non-streaming response body."""
        content = {"message": {"role": "assistant", "content": text}} if self.request.chat else {"text": text}
        choice = _choice(content, finish_reason)
        body = self._envelope(self.object_name, [choice]) | {"usage": self.usage(seq)}
        if self.kv_transfer_params is not None:
            body["kv_transfer_params"] = self.kv_transfer_params
        return body

    def role_chunk(self) -> dict[str, Any]:
        """The first chat chunk, announcing the assistant role."""
        choice = _choice({"delta": {"role": "assistant", "content": ""}}, None)
        return self._envelope(self.chunk_object_name, [choice])

    def token_chunk(self, token: Token) -> dict[str, Any]:
        content = {"delta": {"content": token.text}} if self.request.chat else {"text": token.text}
        choice = _choice(content, token.finish_reason)
        return self._envelope(self.chunk_object_name, [choice])

    def usage_chunk(self, seq: Sequence) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name, []) | {"usage": self.usage(seq)}

    def remote_decode_params(self, seq: Sequence, identity: Identity, config: SimConfig) -> dict[str, Any]:
        """What a vLLM prefill worker (NIXL connector) returns for its decoder: where the KV blocks are."""
        blocks = -(-seq.spec.prompt_tokens // config.block_size)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": identity.pod,
            "remote_block_ids": list(range(blocks)),
            "remote_host": config.host,
            "remote_port": identity.port,
            "tp_size": 1,
        }

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        }


def _choice(content: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- inference handlers


async def completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=True)


async def _inference(request: web.Request, *, chat: bool) -> web.StreamResponse:
    raw = await request.read()
    request.app[JOURNAL_KEY].record(request, raw)
    config = request.app[CONFIG_KEY]
    failure = injected_failure(request)
    if failure is not None:
        raise failure
    parsed = parse_request(decode_body(raw), config, chat=chat)
    engine = request.app[ENGINE_KEY]
    completion = Completion(parsed, _request_id(request, chat=chat))
    spec = RequestSpec.of(
        completion.request_id,
        parsed.model,
        parsed.prompt,
        parsed.max_tokens,
        remote_prefill=parsed.remote_prefill and config.role != "prefill",
    )
    try:
        seq = engine.submit(spec)
    except QueueFullError as exc:
        raise OpenAIError(429, str(exc), "TooManyRequestsError") from None
    if parsed.remote_decode and config.role != "decode":
        completion.kv_transfer_params = completion.remote_decode_params(seq, identity_of(request), config)
    try:
        if parsed.stream:
            return await _stream(request, engine, seq, completion)
        return await _respond(engine, seq, completion)
    finally:
        engine.abort(seq)


_FAILURES: dict[str, tuple[int, str, str]] = {
    "rate_limit": (429, "Rate limit reached (injected failure)", "TooManyRequestsError"),
    "server_error": (500, "Internal server error (injected failure)", "InternalServerError"),
    "invalid_request": (400, "Invalid request (injected failure)", "BadRequestError"),
    "model_not_found": (404, "The model does not exist (injected failure)", "NotFoundError"),
}


def injected_failure(request: web.Request) -> OpenAIError | None:
    """The error to answer instead of serving: forced by ``x-sim-force-error`` or drawn at random."""
    config = request.app[CONFIG_KEY]
    forced = request.headers.get(FORCE_ERROR_HEADER)
    if forced is not None:
        kind = forced.strip().lower()
        if kind not in _FAILURES:
            known = ", ".join(_FAILURES)
            return bad_request(f"Unknown {FORCE_ERROR_HEADER} value {forced!r}; known: {known}")
    elif config.failure_injection_rate > 0 and request.app[RNG_KEY].random() < config.failure_injection_rate:
        kind = request.app[RNG_KEY].choice(config.failure_types)
    else:
        return None
    status, message, error_type = _FAILURES[kind]
    return OpenAIError(status, message, error_type, "model" if kind == "model_not_found" else None)


def _request_id(request: web.Request, *, chat: bool) -> str:
    base = request.headers.get("x-request-id") or uuid.uuid4().hex
    return f"{'chatcmpl' if chat else 'cmpl'}-{base}"


async def _respond(engine: Engine, seq: Sequence, completion: Completion) -> web.Response:
    parts: list[str] = []
    finish_reason: str | None = None
    async with contextlib.aclosing(engine.tokens(seq)) as tokens:
        async for token in tokens:
            parts.append(token.text)
            finish_reason = token.finish_reason
    return _json_response(completion.full("".join(parts), finish_reason, seq))


async def _stream(
    request: web.Request, engine: Engine, seq: Sequence, completion: Completion
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        await _write_chunks(response, engine, seq, completion)
    except ConnectionResetError:
        log.debug("sim.client_disconnected", request_id=completion.request_id)
    return response


async def _write_chunks(
    response: web.StreamResponse, engine: Engine, seq: Sequence, completion: Completion
) -> None:
    async with contextlib.aclosing(engine.tokens(seq)) as tokens:
        async for token in tokens:
            if token.index == 0 and completion.request.chat:
                await response.write(sse(completion.role_chunk()))
            await response.write(sse(completion.token_chunk(token)))
    if completion.request.include_usage:
        await response.write(sse(completion.usage_chunk(seq)))
    await response.write(SSE_DONE)
    await response.write_eof()


# --------------------------------------------------------------------------- other handlers


async def models(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    created = request.app[CREATED_KEY]
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
        }
        for name in config.model_names
    ]
    data += [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": config.model,
        }
        for name in config.lora_modules
    ]
    return _json_response({"object": "list", "data": data})


async def health(_: web.Request) -> web.Response:
    return web.Response(status=200)


GARBAGE_METRICS = b"<html><body>\x00\xff upstream {{ not [prometheus] text\n</body></html>\n"


async def metrics(request: web.Request) -> web.Response:
    fault = request.app[CONFIG_KEY].metrics_fault
    if fault == "error":
        return web.Response(status=500, text="metrics exporter failed\n")
    if fault == "hang":
        await asyncio.Event().wait()  # until the client gives up (the handler is then cancelled)
    if fault == "garbage":
        return web.Response(body=GARBAGE_METRICS, headers={"Content-Type": CONTENT_TYPE_LATEST})
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def debug_requests(request: web.Request) -> web.Response:
    return _json_response(list(request.app[JOURNAL_KEY].entries))


async def clear_debug_requests(request: web.Request) -> web.Response:
    return _json_response({"cleared": request.app[JOURNAL_KEY].clear()})


def _json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON_CONTENT_TYPE)


# --------------------------------------------------------------------------- metrics


class EngineCollector(Collector):
    """Renders the engine's real current state with vLLM's metric names and labels."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        config = self._engine.config
        snap = self._engine.snapshot()
        yield from _state_gauges(config, snap)
        yield from _info_gauges(config, snap)
        yield from _counters(config, snap)
        yield from _histograms(config, snap)


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _state_gauges(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    model = config.model
    yield _gauge(
        "vllm:num_requests_running", "Number of requests in model execution batches.", model, snap.running
    )
    yield _gauge(
        "vllm:num_requests_waiting", "Number of requests waiting to be processed.", model, snap.waiting
    )
    yield _gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", model, snap.kv_cache_usage
    )


def _info_gauges(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    cache = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=["block_size", "model_name", "num_gpu_blocks"],
    )
    cache.add_metric([str(config.block_size), config.model, str(config.kv_cache_size)], 1.0)
    yield cache
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "model_name", "running_lora_adapters", "waiting_lora_adapters"],
    )
    running, waiting = ",".join(snap.running_lora_adapters), ",".join(snap.waiting_lora_adapters)
    lora.add_metric([str(config.max_loras), config.model, running, waiting], snap.timestamp)
    yield lora


def _counters(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    model, counters = config.model, snap.counters
    yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", model, counters.prompt_tokens)
    yield _counter(
        "vllm:generation_tokens", "Number of generation tokens processed.", model, counters.generation_tokens
    )
    success = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=["finished_reason", "model_name"],
    )
    for reason, count in counters.request_success.items():
        success.add_metric([reason, model], count)
    yield success
    yield _counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        model,
        counters.prefix_cache_queries,
    )
    yield _counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        model,
        counters.prefix_cache_hits,
    )


def _histogram(name: str, doc: str, model: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], histogram.cumulative(), histogram.total)
    return family


def _histograms(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    model, counters = config.model, snap.counters
    yield _histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        model,
        counters.time_to_first_token,
    )
    yield _histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        model,
        counters.inter_token_latency,
    )
    yield _histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        model,
        counters.request_queue_time,
    )


# --------------------------------------------------------------------------- application


def build_app(config: SimConfig) -> web.Application:
    """A fresh simulator app with its own engine, journal and metrics registry.

    Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (optionally SSE), ``GET /v1/models``,
    ``/health``, ``/metrics`` (vLLM names) and ``GET``/``DELETE /debug/requests`` (the last requests
    received). Every response carries ``x-inference-pod``, ``-namespace`` and ``-port``; errors use the
    OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    engine = Engine(config)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    app[CONFIG_KEY] = config
    app[ENGINE_KEY] = engine
    app[JOURNAL_KEY] = RequestJournal()
    app[REGISTRY_KEY] = registry
    app[CREATED_KEY] = int(time.time())
    app[RNG_KEY] = random.Random(config.seed)
    app.on_response_prepare.append(add_identity_headers)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/requests", debug_requests)
    app.router.add_delete("/debug/requests", clear_debug_requests)
    return app


class SimServer:
    """Serves one simulator app on ``config.host:config.port`` (port 0 picks a free port).

    Handlers are cancelled when their client disconnects, so a dropped request frees its slot at once.
    Usable as ``async with SimServer(config) as sim: ... sim.url ...``.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.app = build_app(config)
        self.port = config.port
        self._runner: web.AppRunner | None = None

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE_KEY]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.config.host, self.config.port).start()
        self._runner = runner
        self.port = _bound_port(runner, self.config.port)
        log.info("sim.started", url=self.url, pod=self.config.pod_name(self.port), model=self.config.model)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback


def rank_configs(config: SimConfig) -> list[SimConfig]:
    """One config per data-parallel rank: rank ``i`` listens on ``port + i`` (any free port if 0)."""
    step = 1 if config.port else 0
    return [
        dataclasses.replace(config, port=config.port + rank * step, data_parallel_size=1)
        for rank in range(config.data_parallel_size)
    ]


class SimCluster:
    """``data_parallel_size`` independent simulators (ranks), each with its own engine, cache and metrics.

    Usable as ``async with SimCluster(config) as cluster: ... cluster.servers[i].url ...``.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.servers = [SimServer(rank) for rank in rank_configs(config)]

    async def start(self) -> None:
        try:
            for server in self.servers:
                await server.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for server in reversed(self.servers):
            await server.stop()

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()
