"""Replace the top-level ``"model"`` value of a JSON body while keeping every other byte.

Used when the target model differs from the requested one (``x-gateway-model-name-rewrite``).
Unlike the reference (which re-encodes the whole body with Go's rules: sorted keys, float64
numbers), only the model's string literal is replaced, so key order, spacing and large integers
such as ``seed`` reach the model server exactly as the client sent them (quirk Q8).
"""

from __future__ import annotations

import json

_decoder = json.JSONDecoder()
_WS = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def model_value_span(text: str) -> tuple[int, int] | None:
    """Character span of the top-level ``model`` value in a JSON object text (last one wins)."""
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return None
    i = _skip_ws(text, i + 1)
    span = None
    while i < len(text) and text[i] != "}":
        key, i = _decoder.raw_decode(text, i)
        i = _skip_ws(text, i)
        if text[i] != ":":
            return None
        start = _skip_ws(text, i + 1)
        _, end = _decoder.raw_decode(text, start)
        if key == "model":
            span = (start, end)
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return span


def replace_existing_model(body: bytes, model: str) -> bytes:
    """``body`` with its top-level ``model`` set to ``model``; unchanged when it has none or is no JSON."""
    try:
        text = body.decode("utf-8")
        span = model_value_span(text)
    except ValueError:
        return body
    if span is None:
        return body
    start, end = span
    return (text[:start] + json.dumps(model, ensure_ascii=False) + text[end:]).encode()


def model_literal_pairs(old: str, new: str) -> tuple[tuple[bytes, bytes], ...]:
    """Byte replacements of ``"model":"<old>"`` by ``"model":"<new>"`` for the two common spacings."""
    o, n = json.dumps(old).encode(), json.dumps(new).encode()
    return ((b'"model":' + o, b'"model":' + n), (b'"model": ' + o, b'"model": ' + n))


def replace_model(body: bytes, model: str) -> bytes:
    """Return ``body`` with its top-level ``model`` set to ``model`` (added if absent)."""
    text = body.decode("utf-8")
    literal = json.dumps(model, ensure_ascii=False)
    span = model_value_span(text)
    if span is None:
        brace = text.index("{")
        sep = "" if text[brace + 1 :].lstrip().startswith("}") else ","
        return (text[: brace + 1] + f'"model":{literal}{sep}' + text[brace + 1 :]).encode()
    start, end = span
    return (text[:start] + literal + text[end:]).encode()
