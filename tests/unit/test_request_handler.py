"""``requestHandler.parsers``: loading and checking the list, the per-request parser choice by path
suffix, and what the director does with each parser's body (scheduled with or without a model)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

from epp.config import LoadedConfig, load_config
from epp.datalayer.store import EndpointStore
from epp.framework import ApiKind, ErrorCode, InferenceError, LLMRequest, Parser, RequestBody
from epp.plugins.parsers._grpc import grpc_frame
from epp.scheduling.parser_router import ParserRouter
from epp.server.director import Director
from tests.unit import factories
from tests.unit.extproc_harness import body_msg, headers_msg, set_headers, start
from tests.unit.factories import NO_ENV, config_error
from tests.unit.factories import config as load

PICKER = """
- name: maxScore
  type: max-score-picker
"""
PROFILE = """
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: maxScore
"""


def types(cfg: LoadedConfig) -> list[str]:
    return [p.type_name for p in cfg.parsers.parsers]


def chosen(cfg: LoadedConfig, path: str) -> str | None:
    parser = cfg.parsers.resolve(path)
    return None if parser is None else parser.name


# --- loading --------------------------------------------------------------------------------------


def test_default_parsers_and_their_paths() -> None:
    cfg = load("")
    assert types(cfg) == ["openai-parser", "anthropic-parser", "vllmhttp-parser", "passthrough-parser"]
    assert chosen(cfg, "/v1/chat/completions") == "openai-parser"
    assert chosen(cfg, "/v1/completions") == "openai-parser"
    assert chosen(cfg, "/v1/images/generations") == "openai-parser"
    assert chosen(cfg, "/v1/messages") == "anthropic-parser"
    assert chosen(cfg, "/v1/messages/count_tokens") == "anthropic-parser"
    assert chosen(cfg, "/v1/messages/") == "anthropic-parser"
    assert chosen(cfg, "/inference/v1/generate") == "vllmhttp-parser"
    assert chosen(cfg, "/v1/models") == "passthrough-parser"
    assert chosen(cfg, "/") == "passthrough-parser"
    assert cfg.parsers.supported_app_protocols() == ("http", "kubernetes.io/h2c")


def test_explicit_list_has_no_fallback() -> None:  # successMultipleParsersConfigText
    cfg = load(
        "plugins:"
        + PICKER
        + "- type: openai-parser\n- name: secondParser\n  type: anthropic-parser\n"
        + PROFILE
        + "requestHandler:\n  parsers:\n  - pluginRef: openai-parser\n  - pluginRef: secondParser\n"
    )
    assert types(cfg) == ["openai-parser", "anthropic-parser"]
    assert chosen(cfg, "/v1/messages") == "secondParser"
    assert chosen(cfg, "/v1/models") is None
    assert cfg.parsers.fallback is None


def test_explicit_passthrough_is_the_fallback() -> None:  # successExplicitPassthroughConfigText
    cfg = load(
        "plugins:"
        + PICKER
        + "- type: openai-parser\n- name: myFallback\n  type: passthrough-parser\n"
        + PROFILE
        + "requestHandler:\n  parsers:\n  - pluginRef: openai-parser\n  - pluginRef: myFallback\n"
    )
    assert chosen(cfg, "/v1/messages") == "myFallback"
    assert chosen(cfg, "/v1/chat/completions") == "openai-parser"


def test_undeclared_reference_to_a_parser_type_creates_it() -> None:
    cfg = load("requestHandler:\n  parsers:\n  - pluginRef: vllmgrpc-parser\n")
    assert types(cfg) == ["vllmgrpc-parser"]
    assert "vllmgrpc-parser" in cfg.plugins
    assert chosen(cfg, "/vllm.grpc.engine.VllmEngine/Generate") == "vllmgrpc-parser"
    assert cfg.parsers.supported_app_protocols() == ("kubernetes.io/h2c",)


def test_reference_wrong_plugin_type_is_rejected() -> None:  # errorParserWrongPluginTypeText
    e = config_error(
        "plugins:"
        + PICKER
        + "- name: openaiParser\n  type: openai-parser\n"
        + PROFILE
        + "requestHandler:\n  parsers:\n  - pluginRef: maxScore # Wrong type\n"
    )
    assert e.field == "requestHandler.parsers[0].pluginRef"
    assert "the plugin 'maxScore' is not a parser plugin" in e.reason


def test_reference_wrong_plugin_name_is_rejected() -> None:  # errorParserWrongPluginNameText
    e = config_error(
        "plugins:"
        + PICKER
        + "- name: openaiParser\n  type: openai-parser\n"
        + PROFILE
        + "requestHandler:\n  parsers:\n  - pluginRef: wrongParser # Wrong name\n"
    )
    assert e.field == "requestHandler.parsers[0].pluginRef"
    assert "no plugin named 'wrongParser'" in e.reason


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ("requestHandler: {parser: []}\n", "requestHandler.parser", 'unknown field "parser"'),
        ("requestHandler: {parsers: {pluginRef: x}}\n", "requestHandler.parsers", "list"),
        ("requestHandler: {parsers: [{pluginRef: ''}]}\n", "requestHandler.parsers[0].pluginRef", "empty"),
        ("requestHandler: {parsers: [{ref: x}]}\n", "requestHandler.parsers[0].ref", 'unknown field "ref"'),
    ],
)
def test_malformed_request_handler(body: str, field: str, reason: str) -> None:
    e = config_error(body)
    assert e.field == field and reason in e.reason


def test_deprecated_parser_still_works_and_loses_to_request_handler() -> None:
    cfg = load("plugins:\n- {name: a, type: anthropic-parser}\nparser: {pluginRef: a}\n")
    assert types(cfg) == ["anthropic-parser"]
    assert any("top-level parser is deprecated" in w for w in cfg.warnings)
    cfg = load(
        "plugins:\n- {name: a, type: anthropic-parser}\nparser: {pluginRef: a}\n"
        "requestHandler: {parsers: [{pluginRef: openai-parser}]}\n"
    )
    assert types(cfg) == ["openai-parser"]
    assert any("ignored" in w for w in cfg.warnings)


def test_effective_config_round_trips_the_parser_list() -> None:
    cfg = load("requestHandler: {parsers: [{pluginRef: sglanghttp-parser}, {pluginRef: vllmhttp-parser}]}\n")
    doc = yaml.safe_load(cfg.effective_yaml())
    assert doc["requestHandler"] == {
        "parsers": [{"pluginRef": "sglanghttp-parser"}, {"pluginRef": "vllmhttp-parser"}],
        "propagatePriority": False,
    }
    again = load_config(cfg.effective_yaml(), environ=NO_ENV)
    assert types(again) == ["sglanghttp-parser", "vllmhttp-parser"]


def test_duplicate_types_and_parsers_after_the_fallback_are_skipped_with_a_warning() -> None:
    cfg = load(
        "plugins:\n- {name: o1, type: openai-parser}\n- {name: o2, type: openai-parser}\n"
        "- {name: pt, type: passthrough-parser}\n- {name: an, type: anthropic-parser}\n"
        "requestHandler: {parsers: [{pluginRef: o1}, {pluginRef: o2}, {pluginRef: pt}, {pluginRef: an}]}\n"
    )
    assert [p.name for p in cfg.parsers.parsers] == ["o1", "pt"]
    assert chosen(cfg, "/v1/messages") == "pt"
    assert any("'o2' skipped" in w for w in cfg.warnings)
    assert any("'an' skipped" in w and "after the fallback" in w for w in cfg.warnings)


# --- matching --------------------------------------------------------------------------------------


class _Claiming(Parser):
    type_name = "claims-messages"
    claims = ("/messages/",)

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody | None:
        return None


class _AlsoClaiming(_Claiming):
    type_name = "also-claims-messages"


def test_longest_suffix_wins_whatever_the_order() -> None:
    for order in (["sglanghttp-parser", "vllmhttp-parser"], ["vllmhttp-parser", "sglanghttp-parser"]):
        refs = ", ".join(f"{{pluginRef: {t}}}" for t in order)
        cfg = load(f"requestHandler: {{parsers: [{refs}]}}\n")
        assert chosen(cfg, "/inference/v1/generate") == "vllmhttp-parser"
        assert chosen(cfg, "/generate") == "sglanghttp-parser"
        assert chosen(cfg, "/v1/regenerate") == "sglanghttp-parser"  # suffixes match without a boundary


def test_same_suffix_goes_to_the_first_listed_parser() -> None:
    a, b = _Claiming("a", None), _AlsoClaiming("b", None)
    assert ParserRouter.build([a, b]).resolve("/v1/messages") is a
    assert ParserRouter.build([b, a]).resolve("/v1/messages") is b


def test_unclaimed_path_without_fallback_resolves_to_none() -> None:
    router = ParserRouter.build([_Claiming("a", None)])
    assert router.resolve("/v1/message") is None
    assert router.resolve("") is None


# --- the director -------------------------------------------------------------------------------------


@pytest.fixture
def store() -> EndpointStore:
    s = EndpointStore()
    for i in (1, 2, 3):
        s.upsert(factories.metadata(f"e{i}", f"10.0.0.{i}"))
    return s


def _director(store: EndpointStore, cfg: LoadedConfig) -> Director:
    return Director(store, cfg.parsers, cfg.scheduler)


async def test_unclaimed_path_is_a_400_naming_the_path(store: EndpointStore) -> None:
    cfg = load("requestHandler: {parsers: [{pluginRef: openai-parser}]}\n")
    with pytest.raises(InferenceError) as info:
        await _director(store, cfg).route({":path": "/v1/messages?x=1"}, b"{}", {})
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert info.value.message == "no parser registered matching path suffix for: /v1/messages"


async def test_anthropic_message_is_scheduled_with_its_model(store: EndpointStore) -> None:
    body = json.dumps(
        {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    routing = await _director(store, load("")).route({":path": "/v1/messages"}, body, {})
    request = routing.request
    assert isinstance(request, LLMRequest)
    assert request.body.api is ApiKind.MESSAGES and request.incoming_model == request.target_model == "claude"
    assert routing.destination in {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    assert routing.body == body


async def test_anthropic_message_without_model_is_rejected(store: EndpointStore) -> None:
    body = json.dumps({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with pytest.raises(InferenceError) as info:
        await _director(store, load("")).route({":path": "/v1/messages"}, body, {})
    assert info.value.message == "model not found in request body"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models/list", b"\x00binary"),
        ("/v1/messages/count_tokens", b'{"messages":[]}'),
    ],
)
async def test_unread_bodies_are_scheduled_without_a_model(
    store: EndpointStore, path: str, body: bytes
) -> None:
    routing = await _director(store, load("")).route(
        {":path": path, "x-gateway-model-name-rewrite": "other"}, body, {}
    )
    request = routing.request
    assert request is not None, "scheduled, not sent to a random endpoint"
    assert request.body.api is ApiKind.RAW and request.incoming_model == request.target_model == ""
    assert routing.body == body and not routing.body_changed  # never rewritten


async def test_vllm_grpc_generate_is_scheduled_and_forwarded_unchanged(store: EndpointStore) -> None:
    cfg = load("requestHandler: {parsers: [{pluginRef: vllmgrpc-parser}]}\n")
    tokenized = b"\x12\x03\x01\x02\x03"  # TokenizedInput{input_ids: [1, 2, 3]}
    raw = grpc_frame(b"\x12" + bytes([len(tokenized)]) + tokenized + b"\x28\x01")  # + stream: true
    routing = await _director(store, cfg).route(
        {":path": "/vllm.grpc.engine.VllmEngine/Generate", "content-type": "application/grpc"}, raw, {}
    )
    assert routing.request is not None
    assert routing.request.body.token_ids == [1, 2, 3] and routing.request.stream
    assert routing.body == raw


def test_prompt_text_of_each_kind_is_what_prefix_hashing_sees() -> None:
    cases: list[tuple[ApiKind, dict[str, Any], list[int] | None, str]] = [
        (ApiKind.RAW, {"prompt": "ignored"}, None, ""),
        (ApiKind.GENERATE, {"text": "abc"}, None, "abc"),
        (ApiKind.GENERATE, {"text": "abc"}, [7, 8], "7,8"),
        (ApiKind.IMAGES_GENERATIONS, {"prompt": "fox"}, None, "fox"),
    ]
    for api, payload, ids, text in cases:
        assert RequestBody(api=api, payload=payload, raw=b"", token_ids=ids).prompt_text == text


# --- over the ext_proc wire -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/messages", json.dumps({"model": "demo", "messages": []}).encode(), 400),
        ("/v1/unclaimed", b"{}", 400),
    ],
)
async def test_parser_errors_are_immediate_responses(
    store: EndpointStore, path: str, body: bytes, status: int
) -> None:
    cfg = load("requestHandler: {parsers: [{pluginRef: openai-parser}, {pluginRef: anthropic-parser}]}\n")
    h = await start(store, _director(store, cfg))
    try:
        out = await h.exchange([headers_msg({":path": path}), body_msg(body, True)], expect=1)
    finally:
        await h.channel.close()
        await h.server.stop(None)
    assert out[0].WhichOneof("response") == "immediate_response"
    assert out[0].immediate_response.status.code == status


async def test_vllm_grpc_request_is_routed_over_ext_proc(store: EndpointStore) -> None:
    cfg = load("requestHandler: {parsers: [{pluginRef: vllmgrpc-parser}]}\n")
    tokenized = b"\x12\x02\x05\x06"  # TokenizedInput{input_ids: [5, 6]}
    raw = grpc_frame(b"\x0a\x01r\x12" + bytes([len(tokenized)]) + tokenized)
    headers = {
        ":path": "/vllm.grpc.engine.VllmEngine/Generate",
        "content-type": "application/grpc",
        "te": "trailers",
    }
    h = await start(store, _director(store, cfg))
    try:
        out = await h.exchange([headers_msg(headers), body_msg(raw, True)], expect=2)
    finally:
        await h.channel.close()
        await h.server.stop(None)
    dest = set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"]
    assert dest in {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    assert out[1].request_body.response.body_mutation.streamed_response.body == raw
