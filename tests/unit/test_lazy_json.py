"""Long chat bodies parsed lazily: the same values, prompt bytes and errors as the eager parser."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.framework import ApiKind, InferenceError
from epp.plugins.parsers._lazy_json import LazyObject
from epp.plugins.parsers.openai import LAZY_FROM, parse_json

CHAT = ApiKind.CHAT_COMPLETIONS


def _conversation(turns: int = 60, size: int = 2000) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. é ✓ \u2028"}]
    for i in range(turns):
        messages.append({"role": "assistant", "tool_calls": [{"id": f"c{i}", "function": {"name": "f"}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{i} " + "r" * size})
    return {
        "model": "m",
        "stream": True,
        "max_tokens": 7,
        "tools": [{"type": "function"}],
        "messages": messages,
    }


def test_a_long_chat_body_is_lazy_and_reads_as_the_eager_payload() -> None:
    payload = _conversation()
    raw = orjson.dumps(payload)
    assert len(raw) >= LAZY_FROM
    body = parse_json(raw, CHAT)
    assert isinstance(body.payload, LazyObject)
    assert body.stream is True
    assert body.payload.get("model") == "m" and body.payload["max_tokens"] == 7
    assert "tools" in body.payload and "nope" not in body.payload
    assert body.payload.get("nope", 3) == 3
    assert sorted(body.payload) == sorted(payload) and len(body.payload) == len(payload)
    assert dict(body.payload) == payload
    with pytest.raises(KeyError):
        body.payload["nope"]


@pytest.mark.parametrize("limit", [1, 100, 16 * 1024, 10**7])
def test_prompt_prefix_is_the_eager_prompts_start(limit: int) -> None:
    payload = _conversation()
    raw = orjson.dumps(payload)
    lazy = parse_json(raw, CHAT)
    whole = orjson.dumps(payload["messages"])
    assert lazy.prompt_prefix(limit) == whole[:limit]
    assert lazy.prompt_bytes == whole


def test_members_read_after_settle_come_from_a_full_parse() -> None:
    payload = _conversation()
    body = parse_json(orjson.dumps(payload), CHAT)
    assert body.payload["model"] == "m"  # read before
    body.settle()
    assert body.payload["tools"] == payload["tools"]
    assert body.prompt_prefix(500) == orjson.dumps(payload["messages"])[:500]
    assert dict(body.payload) == payload


@pytest.mark.parametrize(
    "messages",
    [None, [], ["text"], [{"role": "user"}, 3], {"role": "user"}],
    ids=["absent", "empty", "strings", "mixed", "object"],
)
def test_invalid_messages_are_rejected_as_by_the_eager_parser(messages: Any) -> None:
    payload: dict[str, Any] = {"model": "m", "pad": "x" * LAZY_FROM}
    if messages is not None:
        payload["messages"] = messages
    raw = orjson.dumps(payload)
    with pytest.raises(InferenceError) as lazy:
        parse_json(raw, CHAT)
    short = orjson.dumps({**payload, "pad": "x"})
    with pytest.raises(InferenceError) as eager:
        parse_json(short, CHAT)
    assert str(lazy.value) == str(eager.value)
    assert lazy.value.code.http_status == 400


def test_bodies_simdjson_does_not_take_are_decided_by_the_eager_parser() -> None:
    pad = "x" * LAZY_FROM
    # a repeated key: the last one wins, as for every JSON parser in Python
    raw = b'{"model":"first","pad":"' + pad.encode() + b'","messages":[{"role":"user"}],"model":"last"}'
    body = parse_json(raw, CHAT)
    assert not isinstance(body.payload, LazyObject) and body.payload["model"] == "last"
    # an integer beyond 64 bits, which orjson reads as a float
    raw = (
        orjson.dumps({"model": "m", "pad": pad, "messages": [{"role": "user"}]})[:-1]
        + b',"n":1'
        + b"0" * 30
        + b"}"
    )
    body = parse_json(raw, CHAT)
    assert not isinstance(body.payload, LazyObject) and body.payload["n"] == 1e30
    # malformed: the eager parser's 400
    with pytest.raises(InferenceError) as bad:
        parse_json(b'{"model":"m","pad":"' + pad.encode() + b'",', CHAT)
    assert bad.value.code.http_status == 400
    assert "request body is not valid JSON" in str(bad.value)


def test_short_bodies_stay_eager() -> None:
    body = parse_json(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), CHAT)
    assert isinstance(body.payload, dict)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(st.dictionaries(st.text(max_size=6), _json, max_size=4), min_size=1, max_size=5),
    extra=st.dictionaries(
        st.text(max_size=6).filter(lambda k: k not in ("messages", "pad")), _json, max_size=4
    ),
)
def test_any_payload_reads_the_same(messages: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    payload = {**extra, "pad": "p" * LAZY_FROM, "messages": messages}
    raw = orjson.dumps(payload)
    body = parse_json(raw, CHAT)
    expected = orjson.loads(raw)
    # top-level keys with a NUL are left to the eager parser (simdjson cannot look them up)
    assert isinstance(body.payload, LazyObject) is not any("\x00" in k for k in payload)
    assert body.prompt_prefix(300) == orjson.dumps(expected["messages"])[:300]
    assert {k: body.payload[k] for k in body.payload} == expected
