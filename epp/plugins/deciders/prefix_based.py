"""``prefix-based-pd-decider``: disaggregate prefill only when the uncached prompt suffix is long."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from epp.framework import ApiKind, CycleState, Endpoint, LLMRequest, RequestBody, register
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.interfaces import Decider

log = structlog.get_logger("epp.deciders")

AVERAGE_CHARS_PER_TOKEN = 4

_NEGATIVE = "nonCachedTokens: nonCachedTokens parameter of prefix disaggregation decider cannot be negative"
_NEGATIVE_PROMPT = "promptTokens: promptTokens parameter of prefix disaggregation decider cannot be negative"


@dataclass(slots=True, frozen=True)
class PrefixBasedPDDeciderParams:
    """``nonCachedTokens``: minimum uncached prompt tokens that make a remote prefill worthwhile;
    ``promptTokens``: minimum prompt tokens (0 = no minimum)."""

    non_cached_tokens: int = 0
    prompt_tokens: int = 0

    def validate(self) -> str | None:
        if self.non_cached_tokens < 0:
            return _NEGATIVE
        if self.prompt_tokens < 0:
            return _NEGATIVE_PROMPT
        return None


def estimate_input_tokens(body: RequestBody) -> int | None:
    """Prompt tokens: exact when a token-producer tokenized the prompt, else estimated for a
    completions or chat request; None for other APIs."""
    tp = body.tokenized
    if tp is not None and tp.exact:
        return len(tp.token_ids)
    if body.api is ApiKind.COMPLETIONS:
        return _completions_tokens(body.payload.get("prompt"))
    if body.api is ApiKind.CHAT_COMPLETIONS:
        return _text_tokens(body.prompt_text)
    return None


def _text_tokens(text: str) -> int:
    return len(text.encode("utf-8")) // AVERAGE_CHARS_PER_TOKEN


def _completions_tokens(prompt: Any) -> int:
    """String items are joined with spaces and estimated as text; each token id counts one."""
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if not isinstance(prompt, list):
        return 0
    texts: list[str] = []
    token_ids = 0
    for item in prompt:
        if isinstance(item, str):
            texts.append(item)
        elif _is_token_id(item):
            token_ids += 1
        elif isinstance(item, list):
            token_ids += sum(1 for t in item if _is_token_id(t))
    return token_ids + (_text_tokens(" ".join(texts)) if texts else 0)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@register
class PrefixBasedPDDecider(Decider):
    type_name = "prefix-based-pd-decider"
    Params = PrefixBasedPDDeciderParams
    params: PrefixBasedPDDeciderParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
        threshold = self.params.non_cached_tokens
        if threshold <= 0:
            return False
        input_tokens = estimate_input_tokens(request.body)
        if input_tokens is None or input_tokens < threshold:
            return False
        if input_tokens < self.params.prompt_tokens:
            return False
        per_endpoint = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
        info = per_endpoint.get(decode_endpoint) if isinstance(per_endpoint, dict) else None
        if not isinstance(info, PrefixCacheMatchInfo):
            log.warning(
                "unable to read prefix cache state of the decode endpoint",
                decider=self.typed_name,
                endpoint=decode_endpoint.metadata.key,
                request_id=request.request_id,
                found=type(info).__name__,
            )
            return False
        cached = info.match_blocks * info.block_size_tokens
        return input_tokens - cached >= threshold
