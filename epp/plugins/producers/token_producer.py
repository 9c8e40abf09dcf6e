"""``token-producer`` (deprecated alias ``tokenizer``): the request's prompt as token ids.

Sets ``request.body.tokenized`` (``TokenizedPrompt``) before filters and scorers run, once per
request (a prompt already tokenized is left alone). Token ids carried by the request (generate
APIs, completions or embeddings given ids) are used as they are. Otherwise one backend:
``estimate`` (the default: byte packing, ``exact=False``), ``vllm`` (a model server's render
endpoints), or ``local`` (a tokenizer directory read by ``epp.tokenization``, an epp extension).
The deprecated ``udsTokenizerConfig`` sidecar is refused at load.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog

from epp.framework import (
    ApiKind,
    CycleState,
    DataProducer,
    Endpoint,
    Handle,
    LLMRequest,
    RequestBody,
    register,
)
from epp.framework.attributes import TOKENIZED_PROMPT_KEY, TokenizedPrompt
from epp.framework.durations import parse_go_duration
from epp.framework.errors import ConfigError
from epp.framework.params import OMIT_UNSET
from epp.framework.registry import deprecate
from epp.plugins.producers._anthropic_chat import messages_to_chat
from epp.plugins.producers._render_client import (
    CHAT_RENDER_PATH,
    COMPLETIONS_RENDER_PATH,
    DEFAULT_MM_TIMEOUT,
    DEFAULT_TIMEOUT,
    DEFAULT_URL,
    RenderClient,
)
from epp.plugins.producers._token_estimate import EstimateParams, Estimator

__all__ = ["LocalParams", "TokenProducer", "TokenProducerParams", "VllmParams"]

TYPE_NAME = "token-producer"
LEGACY_TYPE_NAME = "tokenizer"
LOCAL_INLINE_BYTES = 32 * 1024
"""Prompts up to this size are tokenized on the event loop; larger ones on the plugin's thread."""

log = structlog.get_logger("epp.token_producer")


@dataclass(slots=True, frozen=True)
class VllmParams:
    """``vllm``: the render server (``url``) and per-request timeouts (Go durations)."""

    url: str = ""
    timeout: str = ""
    mm_timeout: str = ""

    def validate(self) -> str | None:
        url = self.url.strip()
        if url and not url.startswith(("http://", "https://")):
            return f"url: must be an http:// URL of the render server, got {self.url!r}"
        for key, value in (("timeout", self.timeout), ("mmTimeout", self.mm_timeout)):
            if value:
                seconds = parse_go_duration(value)
                if seconds is None or seconds <= 0:
                    return f"{key}: must be a positive duration such as '5s', got {value!r}"
        return None

    def seconds(self) -> tuple[float, float]:
        """(timeout, mmTimeout) in seconds, defaults applied."""
        t = parse_go_duration(self.timeout) if self.timeout else None
        mm = parse_go_duration(self.mm_timeout) if self.mm_timeout else None
        return (t or DEFAULT_TIMEOUT, mm or DEFAULT_MM_TIMEOUT)


@dataclass(slots=True, frozen=True)
class LocalParams:
    """``local`` (epp extension): a directory holding ``tokenizer.json`` (+ ``tokenizer_config.json``)."""

    path: str = ""

    def validate(self) -> str | None:
        if not self.path.strip():
            return "path: must name a directory with tokenizer.json (and tokenizer_config.json)"
        return None


_UDS_REFUSED = (
    "the UDS tokenizer sidecar backend (deprecated in llm-d) is not supported by epp; migrate to "
    "'vllm: {url: http://<render server>:8000}' with 'modelName' (vLLM's render endpoints, e.g. a "
    "'vllm launch render' sidecar), or to 'local: {path: <tokenizer directory>}'"
)


@dataclass(slots=True, frozen=True)
class TokenProducerParams:
    """One backend: ``estimate`` (the default), ``vllm`` (or ``modelName`` alone) or ``local``; the
    ones not chosen are left out of the effective configuration."""

    model_name: str = field(default="", metadata=OMIT_UNSET)
    vllm: VllmParams | None = field(default=None, metadata=OMIT_UNSET)
    estimate: EstimateParams | None = field(default=None, metadata=OMIT_UNSET)
    local: LocalParams | None = field(default=None, metadata=OMIT_UNSET)
    uds_tokenizer_config: dict[str, Any] | None = field(
        default=None, metadata={"key": "udsTokenizerConfig", **OMIT_UNSET}
    )

    def effective(self) -> TokenProducerParams:
        """The chosen backend written out with the defaults it uses."""
        if self.backend == "estimate":
            return dataclasses.replace(self, estimate=self.estimate or EstimateParams())
        if self.backend == "vllm":
            cfg = self.vllm or VllmParams()
            timeout, mm_timeout = cfg.seconds()
            return dataclasses.replace(
                self,
                vllm=VllmParams(cfg.url.strip() or DEFAULT_URL, f"{timeout:g}s", f"{mm_timeout:g}s"),
            )
        return self

    def validate(self) -> str | None:
        if self.uds_tokenizer_config:
            return f"udsTokenizerConfig: {_UDS_REFUSED}"
        chosen = [
            k
            for k, on in (
                ("estimate", self.estimate is not None),
                ("vllm", self.vllm is not None or (bool(self.model_name) and self.local is None)),
                ("local", self.local is not None),
            )
            if on
        ]
        if len(chosen) > 1:
            return (
                f"{chosen[1]}: invalid configuration for '{TYPE_NAME}' plugin: only one of 'estimate', "
                "'vllm' (or 'modelName'), 'local' or 'udsTokenizerConfig' may be set"
            )
        if self.vllm is not None and not self.model_name:
            return f"modelName: invalid configuration for '{TYPE_NAME}' plugin: 'modelName' must be specified"
        return None

    @property
    def backend(self) -> str:
        if self.local is not None:
            return "local"
        if self.vllm is not None or self.model_name:
            return "vllm"
        return "estimate"


def given_token_ids(body: RequestBody) -> list[int] | None:
    """Token ids the request carries: generate APIs, or a completions prompt / embeddings input of ids."""
    if body.token_ids is not None:
        return body.token_ids
    if body.api is ApiKind.COMPLETIONS:
        value = body.payload.get("prompt")
    elif body.api is ApiKind.EMBEDDINGS:
        value = body.payload.get("input")
    else:
        return None
    if isinstance(value, list) and value:
        if len(value) == 1 and isinstance(value[0], list):
            value = value[0]  # one prompt given as a list of id lists
        if value and all(type(t) is int and t >= 0 for t in value):
            return value
    return None


@register
class TokenProducer(DataProducer):
    """See the module docstring; parameters and costs in docs/plugins.md."""

    type_name = TYPE_NAME
    Params = TokenProducerParams
    params: TokenProducerParams
    produces = frozenset({TOKENIZED_PROMPT_KEY})

    def __init__(
        self, name: str, params: TokenProducerParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else TokenProducerParams()
        super().__init__(name, params, handle)
        self.backend = params.backend
        # Whether the token ids are the model's (what precise-prefix-cache-producer needs).
        self.exact_tokens = self.backend != "estimate"
        self._estimator: Estimator | None = None
        self._render: RenderClient | None = None
        self._local: _LocalBackend | None = None
        self._probe: asyncio.Task[None] | None = None
        if self.backend == "vllm":
            cfg = params.vllm or VllmParams()
            timeout, mm_timeout = cfg.seconds()
            self._render = RenderClient(
                name, cfg.url.strip() or DEFAULT_URL, params.model_name, timeout, mm_timeout
            )
            self.produce_timeout = max(timeout, mm_timeout)
        elif self.backend == "local":
            assert params.local is not None
            self._local = _LocalBackend(params.local.path)
            self.produce_timeout = DEFAULT_TIMEOUT  # a cold long prompt may take a second or more
        else:
            self._estimator = Estimator(params.estimate)

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        body = request.body
        if body.tokenized is not None:
            return
        ids = given_token_ids(body)
        if ids is not None:
            body.tokenized = TokenizedPrompt(ids)
            return
        if self._estimator is not None:
            est, items = self._estimator.estimate(body, request.headers)
            if est:
                body.tokenized = TokenizedPrompt(est, exact=False, mm_hashes=items)
            return
        if self._render is not None:
            await self._produce_render(body, self._render)
        elif self._local is not None:
            tp = await self._local.tokenize(body)
            if tp is not None and tp.token_ids:
                body.tokenized = tp

    async def _produce_render(self, body: RequestBody, client: RenderClient) -> None:
        api, payload = body.api, body.payload
        if api is ApiKind.CHAT_COMPLETIONS:
            path, multimodal = CHAT_RENDER_PATH, _has_parts(payload.get("messages"))
        elif api is ApiKind.MESSAGES:
            payload = messages_to_chat(payload)
            path, multimodal = CHAT_RENDER_PATH, _has_parts(payload.get("messages"))
        elif api is ApiKind.COMPLETIONS:
            path, multimodal = COMPLETIONS_RENDER_PATH, False
        else:
            return  # the render endpoints take chat and completions requests only
        rendered = await client.render(path, payload, multimodal)
        if rendered is not None and rendered.token_ids:
            body.tokenized = TokenizedPrompt(rendered.token_ids, mm_hashes=rendered.mm_items)

    async def start_serving(self) -> None:
        """Connections and the worker thread are created on first use; the render backend is probed
        once in the background (a server refusing renders is named in the log at once)."""
        if self._render is not None:
            self._probe = asyncio.create_task(self._render.probe(), name=f"{self.name}-render-probe")

    async def stop_serving(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        await self.close()

    async def close(self) -> None:
        """Release the render backend's connections and the local backend's thread."""
        if self._render is not None:
            await self._render.close()
        if self._local is not None:
            self._local.close()


register(TokenProducer, LEGACY_TYPE_NAME)
deprecate(LEGACY_TYPE_NAME, TYPE_NAME, since="v0.9.0", removal="v0.11.0")


def _has_parts(messages: Any) -> bool:
    """Some message has array content (possibly multimodal): the longer timeout applies."""
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and m["content"] for m in messages)


class _LocalBackend:
    """A tokenizer read from a directory; chat prompts are rendered with its template and encoded
    with ``encode_cached``, which tokenizes only the segments not seen recently."""

    __slots__ = ("_busy", "_lib", "_pool", "tok")

    def __init__(self, path: str) -> None:
        from epp import tokenization  # imported with the backend: tokenizers and Jinja2 take ~0.2 s

        self._lib: Any = tokenization
        try:
            self.tok: Any = tokenization.load_tokenizer(path)
        except (OSError, ValueError) as e:
            raise ConfigError("local.path", f"cannot load a tokenizer from {path!r}: {e}") from e
        except Exception as e:  # tokenizers raises its own exception types for a malformed file
            raise ConfigError("local.path", f"cannot load a tokenizer from {path!r}: {e}") from e
        self._pool: ThreadPoolExecutor | None = None
        self._busy = 0

    async def tokenize(self, body: RequestBody) -> TokenizedPrompt | None:
        """The ids the model server computes for this body: the same functions as ``epp sim``."""
        api, payload = body.api, body.payload
        if api is ApiKind.CHAT_COMPLETIONS:
            chat = payload
        elif api is ApiKind.MESSAGES:
            chat = messages_to_chat(payload)
        elif api is ApiKind.COMPLETIONS:
            prompt = payload.get("prompt")
            if not prompt or not isinstance(prompt, (str, list)):
                return None
            size = len(prompt) if isinstance(prompt, str) else len(body.raw)
            return await self._run(size, self._completion_ids, payload)
        else:
            return None
        messages = chat.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return await self._run(len(body.raw) or len(body.prompt_text), self._chat_ids, chat)

    def _completion_ids(self, payload: dict[str, Any]) -> TokenizedPrompt | None:
        try:
            prompts = self._lib.completion_prompts(payload, self.tok)
        except self._lib.PromptError:
            return None
        ids = prompts[0] if len(prompts) == 1 else [t for p in prompts for t in p]
        return TokenizedPrompt(ids)

    def _chat_ids(self, chat: dict[str, Any]) -> TokenizedPrompt | None:
        try:
            return TokenizedPrompt(self._lib.chat_prompt(chat, self.tok))
        except self._lib.PromptError:
            return None

    async def _run(self, size: int, fn: Any, arg: Any) -> TokenizedPrompt | None:
        """``fn(arg)``: inline when small and the thread is idle (the tokenizer's segment cache is
        then never used by two threads at once), else on the plugin's one thread."""
        try:
            if size <= LOCAL_INLINE_BYTES and self._busy == 0:
                result: TokenizedPrompt | None = fn(arg)
                return result
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-producer")
            loop = asyncio.get_running_loop()
            self._busy += 1  # until the thread has finished, even if the request gives up waiting
            job = self._pool.submit(fn, arg)
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._idle))
            return await asyncio.wrap_future(job)
        except Exception as e:  # a template error on one request must not fail the request
            log.debug("local tokenization failed", error=str(e))
            return None

    def _idle(self) -> None:
        self._busy -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
