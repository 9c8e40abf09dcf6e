"""The OpenAI wire format of the simulator: request parsing and validation, response bodies and
SSE chunks, and errors in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from epp.dev.sim.context import Identity
from epp.dev.sim.engine import Sequence, SimConfig, Token
from epp.dev.sim.limits import check_length
from epp.tokenization import Tokenizer
from epp.tokenization.requests import PromptError, chat_prompt, completion_prompts

JSON_CONTENT_TYPE = "application/json"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
        return json_response(body, status=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "BadRequestError", param)


def prompt_error(exc: PromptError) -> OpenAIError:
    return bad_request(exc.message, exc.param)


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


@dataclass(slots=True, frozen=True)
class InferenceRequest:
    """The parts of an OpenAI completions / chat request the simulator acts on."""

    chat: bool
    model: str
    prompt: list[int]
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


def parse_request(
    body: dict[str, Any], config: SimConfig, tokenizer: Tokenizer, *, chat: bool
) -> InferenceRequest:
    """Validate the body (400 on bad fields), then the model (404 when not served); the prompt's
    token ids come from ``tokenizer`` (several completions prompts are served as one)."""
    try:
        if chat:
            prompt = chat_prompt(body, tokenizer)
        else:
            prompts = completion_prompts(body, tokenizer)
            prompt = prompts[0] if len(prompts) == 1 else [i for ids in prompts for i in ids]
        max_tokens = _max_tokens(body, chat=chat)
        check_length(len(prompt), max_tokens, config.max_model_len)
    except PromptError as exc:
        raise prompt_error(exc) from None
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


def model_of(body: dict[str, Any], config: SimConfig) -> str:
    """The request's model (the configured one if absent); 404 when it is not served."""
    return _model(body, config)


def _model(body: dict[str, Any], config: SimConfig) -> str:
    model = body.get("model")
    if model is None:
        return config.model
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model not in config.model_names and model not in config.lora_modules:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return model


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


@dataclass(slots=True)
class Completion:
    """The response being produced for one request; builds the OpenAI bodies and SSE chunks."""

    request: InferenceRequest
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    kv_transfer_params: dict[str, Any] | None = None
    """Returned to a prefill request (``do_remote_decode``) so the decoder can fetch the KV."""
    prompt_tokens_details: bool = True
    """``usage.prompt_tokens_details`` filled (vLLM's ``--enable-prompt-tokens-details``), else null."""

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
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}
            if self.prompt_tokens_details
            else None,
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


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON_CONTENT_TYPE)
