"""The token-in generate APIs on the simulator: vLLM's ``POST /inference/v1/generate``
(``token_ids`` + ``sampling_params``, answered with ``choices[].token_ids``) and SGLang's
``POST /generate`` (``input_ids`` or ``text`` + ``sampling_params.max_new_tokens``, answered with
``text``, ``output_ids`` and ``meta_info``). Token ids are taken as given; text is tokenized as a
completions prompt."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from aiohttp import web

from epp.dev.sim.context import CONFIG_KEY, ENGINE_KEY, JOURNAL_KEY
from epp.dev.sim.engine import Engine, QueueFullError, RequestSpec, Sequence, Token
from epp.dev.sim.inference import injected_failure, off_loop
from epp.dev.sim.limits import check_length
from epp.dev.sim.openai import (
    SSE_DONE,
    OpenAIError,
    bad_request,
    decode_body,
    json_response,
    model_of,
    prompt_error,
    sse,
)
from epp.tokenization import Tokenizer
from epp.tokenization.requests import PromptError, checked_ids


async def vllm_generate(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    config = request.app[CONFIG_KEY]
    tokenizer = request.app[ENGINE_KEY].tokenizer
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise bad_request("token_ids must be a non-empty list of token ids", "token_ids")
    params = _object(body, "sampling_params")
    max_tokens = _positive(params, "max_tokens", "sampling_params")
    prompt = _checked(ids, tokenizer, "token_ids", max_tokens, config.max_model_len)
    model = model_of(body, config)
    request_id = f"generate-tokens-{body.get('request_id') or uuid.uuid4().hex}"
    engine, seq = _submit(request, request_id, model, prompt, max_tokens)
    try:
        if body.get("stream") is True:
            return await _vllm_stream(request, engine, seq, body)
        tokens = await _collect(engine, seq)
        choice = {
            "index": 0,
            "logprobs": None,
            "finish_reason": tokens[-1].finish_reason if tokens else "stop",
            "token_ids": [t.token_id for t in tokens],
        }
        return json_response(
            {
                "request_id": request_id,
                "model": model,
                "choices": [choice],
                "usage": _usage(seq),
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        )
    finally:
        engine.abort(seq)


async def sglang_generate(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    config = request.app[CONFIG_KEY]
    tokenizer = request.app[ENGINE_KEY].tokenizer
    params = _object(body, "sampling_params")
    max_tokens = _positive(params, "max_new_tokens", "sampling_params")
    ids, text = body.get("input_ids"), body.get("text")
    if isinstance(ids, list) and ids:
        prompt = _checked(ids, tokenizer, "input_ids", max_tokens, config.max_model_len)
    elif isinstance(text, str):
        encoded = await off_loop(len(text), tokenizer.prompt_ids, text)
        prompt = _checked(encoded, tokenizer, "text", max_tokens, config.max_model_len)
    else:
        raise bad_request("input_ids or text must be provided", "input_ids")
    model = model_of(body, config) if "model" in body else config.model
    request_id = str(body.get("rid") or uuid.uuid4().hex)
    engine, seq = _submit(request, request_id, model, prompt, max_tokens)
    try:
        if body.get("stream") is True:
            return await _sglang_stream(request, engine, seq, request_id)
        tokens = await _collect(engine, seq)
        return json_response(_sglang_answer(tokens, seq, request_id))
    finally:
        engine.abort(seq)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    request.app[JOURNAL_KEY].record(request, raw)
    failure = injected_failure(request)
    if failure is not None:
        raise failure
    return decode_body(raw)


def _submit(
    request: web.Request, request_id: str, model: str, prompt: list[int], max_tokens: int | None
) -> tuple[Engine, Sequence]:
    engine = request.app[ENGINE_KEY]
    try:
        return engine, engine.submit(RequestSpec.of(request_id, model, prompt, max_tokens))
    except QueueFullError as exc:
        raise OpenAIError(429, str(exc), "TooManyRequestsError") from None


def _checked(
    ids: list[Any], tokenizer: Tokenizer, param: str, max_tokens: int | None, limit: int
) -> list[int]:
    try:
        prompt = checked_ids(ids, tokenizer, param)
        check_length(len(prompt), max_tokens, limit)
    except PromptError as exc:
        raise prompt_error(exc) from None
    return prompt


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object", name)
    return value


def _positive(params: dict[str, Any], name: str, param: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"{param}.{name} must be a positive integer", param)
    return value


async def _collect(engine: Engine, seq: Sequence) -> list[Token]:
    async with contextlib.aclosing(engine.tokens(seq)) as tokens:
        return [token async for token in tokens]


def _usage(seq: Sequence) -> dict[str, Any]:
    prompt, completion = seq.spec.prompt_tokens, seq.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _vllm_stream(
    request: web.Request, engine: Engine, seq: Sequence, body: dict[str, Any]
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    with contextlib.suppress(ConnectionResetError):
        await response.prepare(request)
        async with contextlib.aclosing(engine.tokens(seq)) as tokens:
            async for token in tokens:
                choice = {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": token.finish_reason,
                    "token_ids": [token.token_id],
                }
                await response.write(sse({"request_id": seq.spec.request_id, "choices": [choice]}))
        if include_usage:
            await response.write(
                sse({"request_id": seq.spec.request_id, "choices": [], "usage": _usage(seq)})
            )
        await response.write(SSE_DONE)
        await response.write_eof()
    return response


def _sglang_answer(tokens: list[Token], seq: Sequence, request_id: str) -> dict[str, Any]:
    finish = tokens[-1].finish_reason if tokens else None
    reason: dict[str, Any] | None = None
    if finish == "length":
        reason = {"type": "length", "length": len(tokens)}
    elif finish is not None:
        reason = {"type": "stop", "matched": None}
    return {
        "text": "".join(t.text for t in tokens),
        "output_ids": [t.token_id for t in tokens],
        "meta_info": {
            "id": request_id,
            "finish_reason": reason,
            "prompt_tokens": seq.spec.prompt_tokens,
            "completion_tokens": len(tokens),
            "cached_tokens": seq.cached_tokens,
        },
    }


async def _sglang_stream(
    request: web.Request, engine: Engine, seq: Sequence, request_id: str
) -> web.StreamResponse:
    """SGLang streams the answer so far (cumulative ``text`` and ``output_ids``) per token."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    with contextlib.suppress(ConnectionResetError):
        await response.prepare(request)
        so_far: list[Token] = []
        async with contextlib.aclosing(engine.tokens(seq)) as tokens:
            async for token in tokens:
                so_far.append(token)
                await response.write(sse(_sglang_answer(so_far, seq, request_id)))
        await response.write(SSE_DONE)
        await response.write_eof()
    return response
