"""The OpenAI endpoints of the simulator: ``POST /v1/completions`` and ``/v1/chat/completions``
(optionally streamed, with injected failures) and ``GET /v1/models``."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

import structlog
from aiohttp import web

from epp.dev.sim.context import CONFIG_KEY, CREATED_KEY, ENGINE_KEY, JOURNAL_KEY, RNG_KEY, identity_of
from epp.dev.sim.engine import Engine, QueueFullError, RequestSpec, Sequence
from epp.dev.sim.openai import (
    SSE_DONE,
    Completion,
    OpenAIError,
    bad_request,
    decode_body,
    json_response,
    parse_request,
    sse,
)

log = structlog.get_logger("epp.sim")

FORCE_ERROR_HEADER = "x-sim-force-error"
SESSION_ID_HEADER = "X-Session-ID"


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
    engine = request.app[ENGINE_KEY]
    body = decode_body(raw)
    cache_salt = _cache_salt(body)
    session_id = session_id_of(body, request.headers)
    parsed = await off_loop(len(raw), parse_request, body, config, engine.tokenizer, chat=chat)
    completion = Completion(
        parsed, _request_id(request, chat=chat), prompt_tokens_details=config.enable_prompt_tokens_details
    )
    spec = RequestSpec.of(
        completion.request_id,
        parsed.model,
        parsed.prompt,
        parsed.max_tokens,
        remote_prefill=parsed.remote_prefill and config.role != "prefill",
        cache_salt=cache_salt,
        session_id=session_id,
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


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: a non-empty string that keys the prompt's blocks apart, or absent."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return salt


def session_id_of(body: dict[str, Any], headers: Mapping[str, str]) -> str | None:
    """vLLM's session of a request: the body's ``session_id``, else the ``X-Session-ID`` header,
    else ``vllm_xargs.session_id``; None without one (a non-string is ignored, as vLLM does)."""
    sid = body.get("session_id")
    if isinstance(sid, str) and sid:
        return sid
    sid = headers.get(SESSION_ID_HEADER)
    if sid:
        return sid
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        sid = xargs.get("session_id")
        if isinstance(sid, str) and sid:
            return sid
    return None


OFF_LOOP_BYTES = 64 * 1024
"""Bodies from this size are tokenized on a worker thread, so a long prompt does not stall the loop."""


_P = ParamSpec("_P")
_T = TypeVar("_T")


async def off_loop(size: int, function: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``function(*args, **kwargs)``: inline for a small body, on a worker thread for a large one."""
    if size < OFF_LOOP_BYTES:
        return function(*args, **kwargs)
    return await asyncio.to_thread(function, *args, **kwargs)


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
    return json_response(completion.full("".join(parts), finish_reason, seq))


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
    return json_response({"object": "list", "data": data})
