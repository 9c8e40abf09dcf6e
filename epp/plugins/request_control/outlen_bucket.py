"""``outlen-bucket`` (alpha): predict a request's output length as ``LONG``, ``SHORT`` or ``UNKNOWN``.

A request-header processor: from a chat request's ``chat_template_kwargs`` (``enable_thinking``,
``thinking_budget``), its ``tools`` and the client's output cap it records the bucket as the request
attribute ``outlen-bucket``; ``inflight-load-producer`` (and so ``token-load-scorer``) then counts
4096, 100 or 1000 output tokens for it instead of its ratio estimate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.framework import ApiKind, Handle, LLMRequest, RequestHeaderProcessor, Stability, register
from epp.framework.attributes import OUTLEN_BUCKET_KEY

__all__ = ["LONG", "SHORT", "UNKNOWN", "OutlenBucket", "classify"]

LONG, SHORT, UNKNOWN = "LONG", "SHORT", "UNKNOWN"
LONG_THINKING_BUDGET = 4000  # a thinking_budget above this is LONG (when enable_thinking is unset)
SHORT_OUTPUT_CAP = 500  # a client output cap below this is SHORT
_OUTPUT_CAPS = ("max_output_tokens", "max_completion_tokens", "max_tokens")


def _as_bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        text = v.strip().lower()
        if text in ("1", "t", "true"):
            return True
        if text in ("0", "f", "false"):
            return False
        return None
    if isinstance(v, int | float):
        return v != 0
    return None


def _as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if v.is_integer() else None
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def _output_cap(payload: Mapping[str, Any]) -> int | None:
    for key in _OUTPUT_CAPS:
        cap = _as_int(payload.get(key))
        if cap is not None:
            return cap
    return None


def classify(request: LLMRequest) -> str:
    """The bucket of one request (only chat completions carry the thinking signals)."""
    body = request.body
    if body is None:
        return UNKNOWN
    payload = body.payload
    thinking: bool | None = None
    budget: int | None = None
    tools = False
    if body.api is ApiKind.CHAT_COMPLETIONS:
        kwargs = payload.get("chat_template_kwargs")
        if isinstance(kwargs, Mapping):
            thinking = _as_bool(kwargs.get("enable_thinking"))
            budget = _as_int(kwargs.get("thinking_budget"))
        t = payload.get("tools")
        tools = isinstance(t, list) and len(t) > 0
    if thinking:
        return LONG
    if thinking is None and budget is not None and budget > LONG_THINKING_BUDGET:
        return LONG
    if tools:
        return SHORT  # a tool call without thinking: a short JSON answer
    cap = _output_cap(payload)
    if cap is not None and 0 < cap < SHORT_OUTPUT_CAP:
        return SHORT
    return UNKNOWN


@register
class OutlenBucket(RequestHeaderProcessor):
    type_name = "outlen-bucket"
    stability = Stability.ALPHA

    def __init__(self, name: str, params: Any = None, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)

    def request_header(self, request: LLMRequest) -> None:
        request.state[OUTLEN_BUCKET_KEY] = classify(request)
