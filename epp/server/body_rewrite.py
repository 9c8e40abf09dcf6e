"""Set top-level members of a JSON body (``model``, ``priority``) while keeping every other byte.

Used when the target model differs from the requested one, and to propagate the request's priority
(``requestHandler.propagatePriority``); only the members' value literals change.
"""

from __future__ import annotations

import json
import re

_decoder = json.JSONDecoder()
_WS = " \t\r\n"
# A JSON string literal (unrolled loop: linear, no backtracking), and what a nested value is made of.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NESTED_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_SCALAR = re.compile(r"[^\s,\]}]+")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int:
    """The index after the JSON value starting at ``text[i]``; ``ValueError`` when there is none."""
    try:
        return int(_decoder.raw_decode(text, i)[1])
    except (RecursionError, ValueError):
        return _scan_value_end(text, i)


def _scan_value_end(text: str, i: int) -> int:
    """``_value_end`` without recursion or decoding: brackets are counted outside string literals."""
    c = text[i : i + 1]
    if c == '"':
        m = _STRING.match(text, i)
        if m is None:
            raise ValueError(f"unterminated string at {i}")
        return m.end()
    if c in ("{", "["):
        depth = 0
        for m in _NESTED_TOKEN.finditer(text, i):
            tok = m.group()
            if tok in ("{", "["):
                depth += 1
            elif tok in ("}", "]"):
                depth -= 1
                if depth == 0:
                    return m.end()
        raise ValueError(f"unterminated {c} at {i}")
    m = _SCALAR.match(text, i)
    if m is None:
        raise ValueError(f"no value at {i}")
    return m.end()


def model_value_span(text: str) -> tuple[int, int] | None:
    """Character span of the top-level ``model`` value in a JSON object text (last one wins).

    ``None`` when the object has no top-level ``model``; ``ValueError`` when the text is not a JSON
    object. Values are skipped with the C JSON scanner; one it cannot take (too deep, an integer too
    long for ``int``) is skipped by counting brackets outside string literals.
    """
    return value_spans(text, ("model",)).get("model")


def value_spans(text: str, keys: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """``model_value_span`` for several top-level keys in one scan (the keys present)."""
    i = _skip_ws(text, 0)
    if text[i : i + 1] != "{":
        raise ValueError("not a JSON object")
    i = _skip_ws(text, i + 1)
    spans: dict[str, tuple[int, int]] = {}
    while text[i : i + 1] != "}":
        m = _STRING.match(text, i)
        if m is None:
            raise ValueError(f"expected a key at {i}")
        key = json.loads(m.group())
        i = _skip_ws(text, m.end())
        if text[i : i + 1] != ":":
            raise ValueError(f"expected ':' at {i}")
        start = _skip_ws(text, i + 1)
        end = _value_end(text, start)
        if key in keys:
            spans[key] = (start, end)
        i = _skip_ws(text, end)
        if text[i : i + 1] == ",":
            i = _skip_ws(text, i + 1)
        elif text[i : i + 1] != "}":
            raise ValueError(f"expected ',' or '}}' at {i}")
    return spans


def replace_existing_model(body: bytes, model: str) -> bytes:
    """``body`` with its top-level ``model`` set to ``model``; unchanged when it has none or is no JSON."""
    try:
        text = body.decode("utf-8")
        span = model_value_span(text)
    except ValueError:  # UnicodeDecodeError included
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
    """Return ``body`` with its top-level ``model`` set to ``model`` (added if absent).

    ``ValueError`` (with the reason) when ``body`` is not a UTF-8 JSON object.
    """
    return set_members(body, {"model": json.dumps(model, ensure_ascii=False)})


def set_members(body: bytes, literals: dict[str, str]) -> bytes:
    """``body`` with each top-level member ``key`` set to the JSON ``literal`` (added if absent),
    in one scan; ``ValueError`` when ``body`` is not a UTF-8 JSON object."""
    text = body.decode("utf-8")
    spans = value_spans(text, tuple(literals))
    edits = sorted(((spans[k], v) for k, v in literals.items() if k in spans), reverse=True)
    for (start, end), literal in edits:  # from the end, so earlier spans stay valid
        text = text[:start] + literal + text[end:]
    missing = [f"{json.dumps(k)}:{v}" for k, v in literals.items() if k not in spans]
    if missing:
        brace = text.index("{")
        sep = "" if text[brace + 1 :].lstrip(_WS).startswith("}") else ","
        text = text[: brace + 1] + ",".join(missing) + sep + text[brace + 1 :]
    return text.encode()
