"""The parsed inference request handed to every plugin."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import orjson

from epp.framework.wire import DEFAULT_FAIRNESS_ID


class ApiKind(enum.Enum):
    """Which OpenAI API a request body belongs to (chosen by path suffix)."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    RESPONSES = "responses"
    CONVERSATIONS = "conversations"
    EMBEDDINGS = "embeddings"


@dataclass(slots=True)
class RequestBody:
    """A decoded OpenAI-style body. ``payload`` is the JSON object; ``raw`` the bytes received."""

    api: ApiKind
    payload: dict[str, Any]
    raw: bytes
    stream: bool = False
    _prompt: str | None = None

    @property
    def prompt_text(self) -> str:
        """Text used for prefix matching and token estimates (computed once, on first use)."""
        if self._prompt is None:
            self._prompt = _prompt_text(self.api, self.payload)
        return self._prompt

    @property
    def cache_salt(self) -> str:
        salt = self.payload.get("cache_salt")
        return salt if isinstance(salt, str) else ""


def _prompt_text(api: ApiKind, payload: dict[str, Any]) -> str:
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
