"""Request parsing, body rewriting, the subset hint and flag values."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.flags import parse_bool, parse_duration
from epp.framework import ApiKind, Endpoint, EndpointMetadata, InferenceError
from epp.framework.durations import parse_go_duration
from epp.plugins.parsers.openai import OpenAIParser, api_for_path
from epp.server.body_rewrite import replace_existing_model, replace_model
from epp.server.subset import filter_by_subset, subset_entries
from tests.unit.factories import endpoint

P = OpenAIParser("openai-parser", None)


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", ApiKind.CHAT_COMPLETIONS),
        ("/v1/completions", ApiKind.COMPLETIONS),
        ("/v1/completions?x=1", ApiKind.COMPLETIONS),
        ("/v1/responses", ApiKind.RESPONSES),
        ("/v1/conversations", ApiKind.CONVERSATIONS),
        ("/v1/embeddings", ApiKind.EMBEDDINGS),
        ("/something/else", ApiKind.COMPLETIONS),
    ],
)
def test_api_by_path_suffix(path: str, api: ApiKind) -> None:
    assert api_for_path(path) is api


def test_parse_chat_stream_flag_and_prompt_text() -> None:
    body = P.parse_request(
        b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}',
        {":path": "/v1/chat/completions"},
    )
    assert body is not None and body.api is ApiKind.CHAT_COMPLETIONS and body.stream
    assert body.prompt_text == '[{"role":"user","content":"hi"}]'


def test_stream_counts_only_when_boolean_true() -> None:
    body = P.parse_request(b'{"model":"m","stream":"true","prompt":"x"}', {":path": "/v1/completions"})
    assert body is not None and not body.stream


@pytest.mark.parametrize(
    ("path", "payload", "message"),
    [
        ("/v1/embeddings", b'{"model":"m"}', "invalid embeddings request: must have input field"),
        ("/v1/responses", b'{"model":"m"}', "invalid responses request: must have input field"),
        (
            "/v1/conversations",
            b'{"model":"m","items":[]}',
            "invalid conversations request: must have items field",
        ),
        (
            "/v1/completions",
            b'{"model":"m","prompt":["a",1]}',
            "invalid completions request: must have prompt field",
        ),
        (
            "/v1/completions",
            b'{"model":"m","prompt":""}',
            "invalid completions request: must have prompt field",
        ),
    ],
)
def test_api_validation_errors(path: str, payload: bytes, message: str) -> None:
    with pytest.raises(InferenceError) as e:
        P.parse_request(payload, {":path": path})
    assert e.value.code.http_status == 400 and e.value.message == message


def test_token_id_prompts_are_valid() -> None:
    body = P.parse_request(b'{"model":"m","prompt":[1,2,3]}', {":path": "/v1/completions"})
    assert body is not None and body.payload["prompt"] == [1, 2, 3]


def test_replace_model_keeps_every_other_byte() -> None:
    raw = b'{ "a" : 1.50, "model":"x", "n": 123456789012345678901234567890, "m": {"model": "x"} }'
    out = replace_model(raw, "y")
    assert out == b'{ "a" : 1.50, "model":"y", "n": 123456789012345678901234567890, "m": {"model": "x"} }'


@given(
    st.dictionaries(st.text(min_size=1, max_size=5), st.integers() | st.text(max_size=5), max_size=5),
    st.text(max_size=10),
)
def test_replace_model_property(other: dict[str, object], model: str) -> None:
    import json

    doc = {**other, "model": "orig"}
    out = replace_model(json.dumps(doc).encode(), model)
    assert json.loads(out) == {**other, "model": model}


def _ep(addr: str, port: int) -> Endpoint:
    return endpoint(f"{addr}-{port}", addr, port)


def test_subset_matching_rules() -> None:
    eps = [_ep("10.0.0.1", 8000), _ep("10.0.0.1", 8001), _ep("10.0.0.2", 8000)]
    assert filter_by_subset(eps, ["10.0.0.1:8001"]) == [eps[1]]
    assert filter_by_subset(eps, ["10.0.0.1"]) == [eps[0], eps[1]]
    assert filter_by_subset(eps, []) == []
    assert subset_entries({}) is None
    assert subset_entries(
        {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": "a:1, b:2"}}
    ) == ["a:1", "b:2"]
    assert subset_entries(
        {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["a:1", 3]}}
    ) == ["a:1"]


def test_ipv6_hostport_is_bracketed() -> None:
    assert EndpointMetadata("n", "fd00::1", 8000).hostport == "[fd00::1]:8000"
    assert filter_by_subset([_ep("fd00::1", 8000)], ["[fd00::1]:8000"])[0].metadata.address == "fd00::1"


@pytest.mark.parametrize(
    ("text", "seconds"), [("50ms", 0.05), ("2s", 2.0), ("1m30s", 90.0), ("0.5", 0.5), ("100us", 1e-4)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "seconds"), [(".5s", 0.5), ("1.s", 1.0), ("+2s", 2.0), ("-1m", -60.0), ("3μs", 3e-6), ("0", 0.0)]
)
def test_flag_durations_accept_every_go_duration(text: str, seconds: float) -> None:
    """Flags and the config file parse durations alike (signs, bare fractions, both micro signs)."""
    assert parse_duration(text) == pytest.approx(seconds)
    assert parse_go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "5", "1.5", ".s", "1x", "1s2", "--1s", "1 s", "+"])
def test_invalid_go_durations(text: str) -> None:
    assert parse_go_duration(text) is None


def test_bad_duration_and_bool() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("5 parsecs")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bool("maybe")
    assert parse_bool("false") is False and parse_bool("True") is True


def test_replace_model_at_any_nesting_depth() -> None:
    """Nesting deeper than Python's recursion limit (the C JSON scanner recurses) is skipped iteratively."""
    deep = b'{"model":"x","a":' + b"[" * 5000 + b"]" * 5000 + b',"b":{"model":"x"}}'
    out = replace_model(deep, "y")
    assert out == deep.replace(b'{"model":"x"', b'{"model":"y"', 1)


def test_replace_model_keeps_long_numbers_and_odd_keys() -> None:
    raw = b'{"seed":' + b"9" * 5000 + b', "mod\\u0065l" : "x" ,"s":"}]\\"{"}'
    assert replace_model(raw, "y") == b'{"seed":' + b"9" * 5000 + b', "mod\\u0065l" : "y" ,"s":"}]\\"{"}'


@pytest.mark.parametrize(
    "raw",
    [b'["model"]', b'"model"', b"", b'{"a":1', b'{"a" 1}', b'{"a":"x}', b"{1:2}", b'{"\\x":1}', b"\xff{}"],
)
def test_replace_model_refuses_what_is_not_a_json_object(raw: bytes) -> None:
    with pytest.raises(ValueError):
        replace_model(raw, "y")
    assert replace_existing_model(raw, "y") == raw  # the response path leaves such bodies alone
