"""The parsed inference request handed to every plugin."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from epp.framework.attributes import TokenizedPrompt
from epp.framework.wire import DEFAULT_FAIRNESS_ID, FORWARDED_PATH_HEADER, ORIGINAL_PATH_HEADER

DEFAULT_REQUEST_PATH = "/v1/completions"
"""The path of a request that carries none (no ``:path`` or path header)."""


class ApiKind(enum.Enum):
    """Which API a request body belongs to (chosen by the parser, mostly by path suffix)."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    RESPONSES = "responses"
    CONVERSATIONS = "conversations"
    EMBEDDINGS = "embeddings"
    IMAGES_GENERATIONS = "images_generations"
    MESSAGES = "messages"  # Anthropic Messages API
    GENERATE = "generate"  # token-in generate APIs (vLLM, SGLang, vLLM gRPC)
    RAW = "raw"  # a body the parser does not interpret


@dataclass(slots=True)
class RequestBody:
    """A decoded request body. ``payload`` is the JSON object (the fields a parser extracted for a
    non-JSON body: ``model``, ``prompt``); ``raw`` the bytes received. A parser may hand a payload
    that converts its members when read (``LazyPayload``); ``settle`` tells it the request was
    scheduled.

    ``token_ids``: the prompt's token ids when the request carries them. ``rewritable``: the body is
    JSON whose ``model`` the EPP can rewrite; such a body must name a model. A non-rewritable body
    (protobuf, raw) is scheduled with the model it names, possibly none, and forwarded unchanged.
    """

    api: ApiKind
    payload: Mapping[str, Any]
    raw: bytes
    stream: bool = False
    token_ids: list[int] | None = None
    rewritable: bool = True
    tokenized: TokenizedPrompt | None = None  # set by a token-producer (TOKENIZED_PROMPT_KEY)
    _prompt: str | None = None
    _prompt_bytes: bytes | None = None

    @property
    def prompt_text(self) -> str:
        """Text used for prefix matching and token estimates (computed once, on first use).

        Token ids, when given, are rendered as comma-separated decimals: equal token prefixes give
        equal text prefixes.
        """
        if self._prompt is None:
            ids = self.token_ids
            if ids is not None:
                self._prompt = ",".join(map(str, ids))
            elif self._prompt_bytes is not None:
                self._prompt = self._prompt_bytes.decode()
            else:
                self._prompt = _prompt_text(self.api, self.payload)
        return self._prompt

    @property
    def prompt_bytes(self) -> bytes:
        """``prompt_text`` UTF-8 encoded (what prefix hashing reads), computed once: a JSON prompt
        (messages, tools) is serialised straight to bytes, without a text copy of a long prompt."""
        if self._prompt_bytes is None:
            if self._prompt is None and self.token_ids is None:
                self._prompt_bytes = _prompt_json(self.api, self.payload)
            if self._prompt_bytes is None:
                self._prompt_bytes = self.prompt_text.encode()
        return self._prompt_bytes

    def prompt_prefix(self, limit: int) -> bytes:
        """The first ``limit`` bytes of ``prompt_bytes`` (all when shorter), serialising no more of a
        long JSON prompt than that: prefix hashing of a long agentic conversation reads its start."""
        if self._prompt_bytes is None and self._prompt is None and self.token_ids is None:
            prefix = _prompt_prefix(self.api, self.payload, limit)
            if prefix is not None:
                return prefix[:limit]
        return self.prompt_bytes[:limit]

    def settle(self) -> None:
        """Scheduling is over (or the request waits in a queue): a lazy payload lets its parse
        buffers go."""
        settle = getattr(self.payload, "settle", None)
        if settle is not None:
            settle()

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt: ``cache_salt`` in every API (SGLang's ``/generate`` too, whose
        ``extra_key`` is another namespace that its KV events do not carry)."""
        salt = self.payload.get("cache_salt")
        return salt if isinstance(salt, str) else ""


def request_path(headers: Mapping[str, str]) -> str:
    """The request's path without its query string: ``:path``, else ``x-original-path``, else
    ``x-forwarded-path``, else ``/v1/completions``."""
    path = (
        headers.get(":path")
        or headers.get(ORIGINAL_PATH_HEADER)
        or headers.get(FORWARDED_PATH_HEADER)
        or DEFAULT_REQUEST_PATH
    )
    return path.partition("?")[0]


def _json_prefix(items: Iterable[Any], limit: int) -> bytes:
    """The first bytes (at least ``limit``, else all) of ``orjson.dumps(items)``: the items are
    serialised one at a time (compact output is ``[a,b,...]``), stopping once there are enough."""
    parts = [b"["]
    size = 1
    for i, item in enumerate(items):
        if size >= limit:
            return b"".join(parts)
        piece = orjson.dumps(item) if i == 0 else b"," + orjson.dumps(item)
        parts.append(piece)
        size += len(piece)
    parts.append(b"]")
    return b"".join(parts)


class LazyPayload(Protocol):
    """A payload whose members become Python objects when read (see ``RequestBody``)."""

    def array_items(self, key: str) -> Iterator[Any] | None:
        """The elements of array member ``key``, each converted when reached (none when absent);
        None when the member is not an array."""

    def settle(self) -> None: ...


def _array_items(payload: Mapping[str, Any], key: str) -> Iterable[Any] | None:
    """Array member ``key`` (``[]`` when absent), element by element for a lazy payload."""
    items = getattr(payload, "array_items", None)
    if items is not None:
        lazy: Iterable[Any] | None = items(key)
        return lazy
    value = payload.get(key, [])
    return value if isinstance(value, list) else None


def _prompt_prefix(api: ApiKind, payload: Mapping[str, Any], limit: int) -> bytes | None:
    """At least ``limit`` bytes (else all) of the JSON prompt's start, or None (not a JSON prompt)."""
    if api is ApiKind.CHAT_COMPLETIONS:
        messages = _array_items(payload, "messages")
        return _json_prefix(messages, limit) if messages is not None else None
    if api is ApiKind.MESSAGES:
        items = [payload.get("system"), payload.get("tools"), payload.get("messages")]
        messages = items[2]
        if not isinstance(messages, list):
            return None
        head = orjson.dumps(items[:2])[:-1] + b","  # "[system,tools," of "[system,tools,messages]"
        return head + _json_prefix(messages, max(limit - len(head), 0)) + b"]"
    return None


def _prompt_json(api: ApiKind, payload: Mapping[str, Any]) -> bytes | None:
    """The prompt of the APIs whose prompt text is JSON, as bytes; None for the others."""
    if api is ApiKind.CHAT_COMPLETIONS:
        return orjson.dumps(payload.get("messages", []))
    if api is ApiKind.MESSAGES:
        return orjson.dumps([payload.get("system"), payload.get("tools"), payload.get("messages")])
    return None


def _prompt_text(api: ApiKind, payload: Mapping[str, Any]) -> str:
    if api is ApiKind.RAW:
        return ""
    if api is ApiKind.MESSAGES:
        return orjson.dumps([payload.get("system"), payload.get("tools"), payload.get("messages")]).decode()
    if api is ApiKind.IMAGES_GENERATIONS or api is ApiKind.GENERATE:
        prompt = payload.get("prompt", payload.get("text"))
        return prompt if isinstance(prompt, str) else ""
    if api is ApiKind.COMPLETIONS:
        prompt = payload.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return " ".join(prompt)
        return ""
    if api is ApiKind.CHAT_COMPLETIONS:
        return orjson.dumps(payload.get("messages", [])).decode()
    if api is ApiKind.RESPONSES:
        parts = [
            {"instructions": payload.get("instructions")},
            {"tools": payload.get("tools")},
            {"input": payload.get("input")},
        ]
        return orjson.dumps(parts).decode()
    if api is ApiKind.CONVERSATIONS:
        return orjson.dumps(payload.get("items", [])).decode()
    return orjson.dumps(payload.get("input", "")).decode()


@dataclass(slots=True)
class LLMRequest:
    """One inference request as seen by admission, scheduling and the request-control hooks.

    The parser fills ``body``; the director adds the target model, the priority and the candidates.
    ``headers`` is the live request-header map: a PreRequest plugin that sets a header there (e.g.
    ``x-prefiller-host-port``) has it forwarded upstream. Prompt text is derived lazily.
    """

    request_id: str
    body: RequestBody
    headers: dict[str, str]
    incoming_model: str
    target_model: str
    priority: int = 0
    objective: str = ""
    fairness_id: str = DEFAULT_FAIRNESS_ID
    request_size_bytes: int = 0
    slo_ttft_ms: float = 0.0  # x-llm-d-slo-ttft-ms (or x-slo-ttft-ms); 0: none
    slo_tpot_ms: float = 0.0  # x-llm-d-slo-tpot-ms (or x-slo-tpot-ms); 0: none
    state: dict[str, Any] = field(default_factory=dict)  # per-request plugin state (PluginState)

    @property
    def stream(self) -> bool:
        return self.body.stream
