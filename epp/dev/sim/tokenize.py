"""vLLM's tokenizer endpoints on the simulator, with vLLM's request and response shapes.

``POST /tokenize`` (a ``prompt`` or chat ``messages``) answers ``{count, max_model_len, tokens,
token_strs}``; ``POST /detokenize`` answers ``{prompt}``; ``POST /v1/completions/render`` answers
one ``GenerateRequest`` object per prompt and ``POST /v1/chat/completions/render`` one object
(``request_id``, ``token_ids``, ``features``, ``sampling_params``, ``model``, ``stream``, ...). The
ids are the ones the engine itself would get for the same request.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from epp.dev.sim.context import CONFIG_KEY, ENGINE_KEY
from epp.dev.sim.engine import SimConfig
from epp.dev.sim.inference import off_loop
from epp.dev.sim.openai import bad_request, decode_body, json_response, model_of, prompt_error
from epp.tokenization import Tokenizer
from epp.tokenization.requests import PromptError, chat_prompt, checked_ids, completion_prompts


async def tokenize(request: web.Request) -> web.Response:
    raw = await request.read()
    body = decode_body(raw)
    config, tokenizer = request.app[CONFIG_KEY], request.app[ENGINE_KEY].tokenizer
    model_of(body, config)
    if isinstance(body.get("prompt"), str):
        tokens = await off_loop(len(raw), _ids, _completion_ids, body, tokenizer)
    elif "messages" in body:
        tokens = await off_loop(len(raw), _ids, chat_prompt, body, tokenizer)
    else:
        raise bad_request("the body must have a string prompt or a list of messages")
    strs = _optional_bool(body, "return_token_strs")
    return json_response(
        {
            "count": len(tokens),
            "max_model_len": config.max_model_len,
            "tokens": tokens,
            "token_strs": tokenizer.token_strs(tokens) if strs else None,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    body = decode_body(await request.read())
    tokenizer = request.app[ENGINE_KEY].tokenizer
    model_of(body, request.app[CONFIG_KEY])
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("tokens must be a list of token ids", "tokens")
    ids = _ids(checked_ids, tokens, tokenizer, "tokens")
    return json_response({"prompt": tokenizer.decode(ids)})


async def render_completions(request: web.Request) -> web.Response:
    raw = await request.read()
    body = decode_body(raw)
    config, tokenizer = request.app[CONFIG_KEY], request.app[ENGINE_KEY].tokenizer
    model = model_of(body, config)
    prompts = await off_loop(len(raw), _ids, completion_prompts, body, tokenizer)
    return json_response([_generate_request(body, ids, model, config, "cmpl") for ids in prompts])


async def render_chat(request: web.Request) -> web.Response:
    raw = await request.read()
    body = decode_body(raw)
    config, tokenizer = request.app[CONFIG_KEY], request.app[ENGINE_KEY].tokenizer
    model = model_of(body, config)
    ids = await off_loop(len(raw), _ids, chat_prompt, body, tokenizer)
    return json_response(_generate_request(body, ids, model, config, "chatcmpl"))


def _completion_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    return completion_prompts(body, tokenizer)[0]


def _ids(function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except PromptError as exc:
        raise prompt_error(exc) from None


def _generate_request(
    body: dict[str, Any], ids: list[int], model: str, config: SimConfig, prefix: str
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for one rendered prompt (``max_tokens`` as vLLM fills it in)."""
    room = config.max_model_len - len(ids)
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = min(asked, room) if isinstance(asked, int) and not isinstance(asked, bool) else room
    stream = body.get("stream") is True
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": _sampling_params(body, max_tokens),
        "model": body.get("model", model),
        "stream": stream,
        "stream_options": body.get("stream_options") if stream else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
    }


def _sampling_params(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    stop = body.get("stop")
    return {
        "n": body.get("n", 1),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "seed": body.get("seed"),
        "stop": [stop] if isinstance(stop, str) else (stop or []),
        "max_tokens": max_tokens,
    }


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value
