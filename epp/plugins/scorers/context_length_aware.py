"""``context-length-aware``: route requests by length to endpoints labelled with a length range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epp.framework import ApiKind, CycleState, Endpoint, Filter, Handle, LLMRequest, Scorer, register

DEFAULT_LABEL = "llm-d.ai/context-length-range"
CHARS_TO_TOKENS = 0.25
_MAX_FALLBACK = 0.3
_RANGE_CACHE_LIMIT = 1024


@dataclass(slots=True, frozen=True)
class ContextLengthAwareParams:
    label: str = DEFAULT_LABEL
    enable_filtering: bool = False

    def validate(self) -> str | None:
        if not self.label:
            return "label: invalid configuration for 'context-length-aware' plugin: 'label' must be specified"
        return None


def _byte_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8"))


def _chat_chars(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += _byte_len(content)
        elif isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "text":
                    text = block.get("text")
                    total += (_byte_len(text) if isinstance(text, str) else 0) + 1
    return total


def request_length(request: LLMRequest) -> int:
    """The request's length in tokens: exact when a token-producer tokenized it, else estimated."""
    body = request.body
    tp = body.tokenized
    if tp is not None and tp.exact:
        return len(tp.token_ids)
    if body.api is ApiKind.COMPLETIONS:
        prompt = body.payload.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)  # token ids: exact
        chars = _byte_len(body.prompt_text)
    elif body.api is ApiKind.CHAT_COMPLETIONS:
        chars = _chat_chars(body.payload.get("messages"))
    else:
        chars = _byte_len(body.prompt_text)
    return int(chars * CHARS_TO_TOKENS)


def _parse_bound(s: str) -> int | None:
    s = s.strip()
    digits = s[1:] if s.startswith("+") else s
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits)


def parse_range(value: str) -> tuple[int, int] | None:
    """``(min, max)`` from a ``min-max`` label value, or None when it does not parse."""
    parts = value.split("-")
    if len(parts) != 2:
        return None
    lo, hi = _parse_bound(parts[0]), _parse_bound(parts[1])
    if lo is None or hi is None or lo > hi:
        return None
    return lo, hi


def _range_score(length: int, lo: int, hi: int) -> float:
    if lo <= length <= hi:
        width = hi - lo
        if width == 0:
            return 1.0
        raw = 0.7 * (1.0 / (1.0 + width / 10000.0)) + 0.3 * ((hi - length) / width)
        return _MAX_FALLBACK + raw * (1.0 - _MAX_FALLBACK)
    distance = length - hi if length > hi else lo - length
    return _MAX_FALLBACK / (1.0 + distance / 1000.0)


@register
class ContextLengthAware(Scorer, Filter):
    type_name = "context-length-aware"
    category = "Affinity"
    Params = ContextLengthAwareParams
    params: ContextLengthAwareParams

    def __init__(self, name: str, params: ContextLengthAwareParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._label = params.label
        self._filtering = params.enable_filtering
        # label value -> parsed range (None = unparsable); label values are few and stable
        self._ranges: dict[str, tuple[int, int] | None] = {}

    def _range(self, value: str) -> tuple[int, int] | None:
        try:
            return self._ranges[value]
        except KeyError:
            if len(self._ranges) >= _RANGE_CACHE_LIMIT:
                self._ranges.clear()
            parsed = self._ranges[value] = parse_range(value)
            return parsed

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        length = request_length(request)
        label = self._label
        out = []
        for e in endpoints:
            value = e.metadata.labels.get(label)
            if value is None:
                out.append(0.5)
                continue
            r = self._range(value)
            out.append(0.0 if r is None else _range_score(length, r[0], r[1]))
        return out

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        if not self._filtering:
            return endpoints
        length = request_length(request)
        label = self._label
        out = []
        for e in endpoints:
            value = e.metadata.labels.get(label)
            if value is None:
                out.append(e)
                continue
            r = self._range(value)
            if r is not None and r[0] <= length <= r[1]:
                out.append(e)
        return out
