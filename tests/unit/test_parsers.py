"""The request parsers other than the OpenAI JSON basics: Anthropic, vLLM and SGLang generate,
passthrough, vLLM gRPC and Vertex AI, on bodies shaped as each API documents them.

gRPC bodies are encoded by the protobuf runtime from the repository's ``proto/`` files (compiled
here with ``grpc_tools``), so the parsers' own wire reader is checked against a real encoder.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from epp.framework import ApiKind, ErrorCode, InferenceError, RequestBody
from epp.plugins.parsers._grpc import grpc_frame
from epp.plugins.parsers.anthropic import AnthropicParser
from epp.plugins.parsers.openai import OpenAIParser
from epp.plugins.parsers.passthrough import PassthroughParser
from epp.plugins.parsers.sglanghttp import SGLangHttpParser
from epp.plugins.parsers.vertexai import VertexAIParser
from epp.plugins.parsers.vllmgrpc import VllmGrpcParser
from epp.plugins.parsers.vllmhttp import VllmHttpParser

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"

ANTHROPIC = AnthropicParser("anthropic-parser", None)
VLLM_HTTP = VllmHttpParser("vllmhttp-parser", None)
SGLANG = SGLangHttpParser("sglanghttp-parser", None)
PASSTHROUGH = PassthroughParser("passthrough-parser", None)
VLLM_GRPC = VllmGrpcParser("vllmgrpc-parser", None)
VERTEX = VertexAIParser("vertexai-parser", None)
OPENAI = OpenAIParser("openai-parser", None)

GRPC_HEADERS = {"content-type": "application/grpc", "te": "trailers"}


def _parse(parser: Any, path: str, body: bytes | dict[str, Any], **headers: str) -> RequestBody:
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    result = parser.parse_request(raw, {":path": path, **headers})
    assert result is not None
    return result


def _bad(parser: Any, path: str, body: bytes | dict[str, Any], **headers: str) -> str:
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    with pytest.raises(InferenceError) as info:
        parser.parse_request(raw, {":path": path, **headers})
    assert info.value.code is ErrorCode.BAD_REQUEST
    return info.value.message


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleType]:
    """The generated protobuf modules of ``proto/`` (vllm_engine, vertexai_prediction)."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path_factory.mktemp("pb")
    files = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
    assert protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", *files]) == 0
    sys.path.insert(0, str(out))
    try:
        return {
            name: importlib.import_module(f"{name}_pb2") for name in ("vllm_engine", "vertexai_prediction")
        }
    finally:
        sys.path.remove(str(out))


# --- anthropic-parser -----------------------------------------------------------------------------

MESSAGES_BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 1024,
    "system": [
        {"type": "text", "text": "You are a terse assistant."},
        {"type": "text", "text": "Long shared context here.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this image?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                },
            ],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "What colour is it?"},
    ],
    "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    "stream": True,
}


def test_anthropic_messages_with_system_and_content_blocks() -> None:
    body = _parse(ANTHROPIC, "/v1/messages", MESSAGES_BODY)
    assert body.api is ApiKind.MESSAGES
    assert body.payload["model"] == "claude-sonnet-4-5"
    assert body.stream and body.rewritable
    prompt = body.prompt_text
    # system first, then tools, then the conversation: a shared system prompt is a shared prefix
    assert prompt.index("Long shared context") < prompt.index("get_weather") < prompt.index("What is in this")
    assert "What colour is it?" in prompt


def test_anthropic_prompt_prefix_is_shared_by_requests_with_the_same_system_prompt() -> None:
    a = _parse(ANTHROPIC, "/v1/messages", MESSAGES_BODY).prompt_text
    other = {**MESSAGES_BODY, "messages": [{"role": "user", "content": "Something else"}]}
    b = _parse(ANTHROPIC, "/v1/messages", other).prompt_text
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert a[:common].count("Long shared context") == 1


def test_anthropic_path_with_a_query_string() -> None:
    body = _parse(ANTHROPIC, "/v1/messages?beta=true", MESSAGES_BODY)
    assert body.api is ApiKind.MESSAGES


def test_anthropic_count_tokens_is_forwarded_unread() -> None:
    raw = json.dumps({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "Hi"}]}).encode()
    body = _parse(ANTHROPIC, "/v1/messages/count_tokens", raw)
    assert body.api is ApiKind.RAW and not body.rewritable
    assert body.payload == {} and body.raw == raw
    assert _parse(ANTHROPIC, "/v1/messages/count_tokens", b"not json").api is ApiKind.RAW


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "request body is not valid JSON: "),
        (b"[]", "request body must be a JSON object, got an array"),
        (b'"hi"', "request body must be a JSON object, got a string"),
        ({"model": "m", "messages": []}, "invalid messages request: must have at least one message"),
        ({"model": "m"}, "invalid messages request: must have at least one message"),
        ({"model": "m", "messages": "hi"}, "messages must be an array of objects"),
        ({"model": "m", "system": 3, "messages": [{"role": "user", "content": "x"}]}, "system must be"),
    ],
)
def test_anthropic_bad_bodies(body: bytes | dict[str, Any], message: str) -> None:
    assert message in _bad(ANTHROPIC, "/v1/messages", body)


def test_anthropic_other_path_is_rejected() -> None:
    assert "unsupported API endpoint: /v1/chat/completions" in _bad(
        ANTHROPIC, "/v1/chat/completions", MESSAGES_BODY
    )


# --- vllmhttp-parser --------------------------------------------------------------------------------

GENERATE_BODY: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "token_ids": [128000, 791, 6864, 315, 9822, 374],
    "sampling_params": {"max_tokens": 16, "temperature": 0.0},
    "stream": False,
    "cache_salt": "tenant-a",
}


def test_vllm_generate_reads_token_ids() -> None:
    body = _parse(VLLM_HTTP, "/inference/v1/generate", GENERATE_BODY)
    assert body.api is ApiKind.GENERATE
    assert body.token_ids == GENERATE_BODY["token_ids"]
    assert body.payload["model"] == GENERATE_BODY["model"] and body.rewritable
    assert not body.stream
    assert body.cache_salt == "tenant-a"
    assert body.prompt_text == "128000,791,6864,315,9822,374"


def test_vllm_generate_equal_token_prefixes_give_equal_text_prefixes() -> None:
    a = _parse(VLLM_HTTP, "/inference/v1/generate", GENERATE_BODY).prompt_text
    b = _parse(
        VLLM_HTTP, "/inference/v1/generate", {**GENERATE_BODY, "token_ids": [128000, 791, 1]}
    ).prompt_text
    assert a.startswith("128000,791,") and b.startswith("128000,791,")


@pytest.mark.parametrize(
    "ids", [None, [], [1, -2], [1, True], [1, 2.5], [1, 1 << 32], "1 2 3", [[1, 2]]], ids=repr
)
def test_vllm_generate_needs_uint32_token_ids(ids: Any) -> None:
    payload = dict(GENERATE_BODY)
    if ids is None:
        del payload["token_ids"]
    else:
        payload["token_ids"] = ids
    assert _bad(VLLM_HTTP, "/inference/v1/generate", payload) == (
        "invalid generate request: must have non-empty token_ids field"
    )


def test_vllm_generate_rejects_other_paths_and_non_objects() -> None:
    assert _bad(VLLM_HTTP, "/v1/completions", GENERATE_BODY) == "unsupported path: /v1/completions"
    assert _bad(VLLM_HTTP, "/inference/v1/generate", b"[1,2]") == (
        "request body must be a JSON object, got an array"
    )
    assert _bad(VLLM_HTTP, "/inference/v1/generate", b"{").startswith("request body is not valid JSON: ")


# --- sglanghttp-parser --------------------------------------------------------------------------------


def test_sglang_generate_with_input_ids_and_salt() -> None:
    payload = {
        "input_ids": [1, 15043, 29892, 920],
        "sampling_params": {"max_new_tokens": 32, "temperature": 0},
        "stream": True,
        "cache_salt": "tenant-b",
        "extra_key": "class-1",
    }
    body = _parse(SGLANG, "/generate", payload)
    assert body.api is ApiKind.GENERATE and body.token_ids == [1, 15043, 29892, 920]
    assert body.stream and not body.rewritable
    assert body.cache_salt == "tenant-b"  # what SGLang salts its cache and its KV events with


def test_sglang_extra_key_is_not_the_salt() -> None:
    """SGLang keys its cache on ``extra_key`` too, but its KV events carry only ``cache_salt``: a
    request with an ``extra_key`` alone finds its blocks unsalted, as the events report them."""
    body = _parse(SGLANG, "/generate", {"input_ids": [1, 2], "extra_key": "tenant-b"})
    assert body.cache_salt == ""


def test_sglang_generate_with_text() -> None:
    body = _parse(
        SGLANG, "/generate/", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
    )
    assert body.token_ids is None
    assert body.prompt_text == "The capital of France is"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"sampling_params": {}}, "input_ids or text must be provided"),
        ({"text": ""}, "input_ids or text must be provided"),
        ({"input_ids": []}, "input_ids must be a non-empty array of uint32 integers"),
        ({"input_ids": [[1, 2], [3]]}, "input_ids must be a non-empty array of uint32 integers"),
        ({"input_ids": [1], "extra_key": 7}, "extra_key must be a string"),
        ({"input_ids": [1], "cache_salt": ["a"]}, "cache_salt must be a string"),
    ],
)
def test_sglang_bad_bodies(payload: dict[str, Any], message: str) -> None:
    assert message in _bad(SGLANG, "/generate", payload)


def test_sglang_serves_only_generate_itself() -> None:
    assert _bad(SGLANG, "/v1/generate", {"text": "x"}) == "unsupported path: /v1/generate"


# --- passthrough-parser ---------------------------------------------------------------------------------


def test_passthrough_takes_any_body_unread() -> None:
    raw = b"\x00\xffnot json at all"
    body = _parse(PASSTHROUGH, "/anything", raw)
    assert body.api is ApiKind.RAW and body.raw == raw
    assert body.payload == {} and not body.rewritable and body.prompt_text == ""
    assert PASSTHROUGH.claims == () and PASSTHROUGH.supported_app_protocols() == ()


# --- vllmgrpc-parser ----------------------------------------------------------------------------------

GEN_PATH = "/vllm.grpc.engine.VllmEngine/Generate"
EMBED_PATH = "/vllm.grpc.engine.VllmEngine/Embed"


def test_vllm_grpc_generate_tokenized(pb: dict[str, ModuleType]) -> None:
    v = pb["vllm_engine"]
    ids = [1, 127, 128, 300, 128000, 4294967295]  # 1- to 5-byte varints
    msg = v.GenerateRequest(
        request_id="req-1",
        tokenized=v.TokenizedInput(original_text="hello", input_ids=ids),
        sampling_params=v.SamplingParams(temperature=0.5, max_tokens=64),
        stream=True,
    )
    raw = grpc_frame(msg.SerializeToString())
    body = _parse(VLLM_GRPC, GEN_PATH, raw, **GRPC_HEADERS)
    assert body.api is ApiKind.GENERATE and body.token_ids == ids
    assert body.stream and not body.rewritable and body.raw == raw
    assert body.payload == {}


def test_vllm_grpc_generate_text(pb: dict[str, ModuleType]) -> None:
    v = pb["vllm_engine"]
    raw = grpc_frame(v.GenerateRequest(request_id="r", text="Once upon a time").SerializeToString())
    body = _parse(VLLM_GRPC, GEN_PATH, raw, **GRPC_HEADERS)
    assert body.token_ids is None and body.prompt_text == "Once upon a time" and not body.stream


def test_vllm_grpc_embed(pb: dict[str, ModuleType]) -> None:
    v = pb["vllm_engine"]
    raw = grpc_frame(
        v.EmbedRequest(request_id="e", tokenized=v.TokenizedInput(input_ids=[5, 6, 7])).SerializeToString()
    )
    body = _parse(VLLM_GRPC, EMBED_PATH, raw, **GRPC_HEADERS)
    assert body.api is ApiKind.EMBEDDINGS and body.token_ids == [5, 6, 7]


def test_vllm_grpc_unpacked_repeated_ids_are_read_too() -> None:
    # TokenizedInput{input_ids: 3, 4} written unpacked (tag 0x10 per value), inside field 2.
    tokenized = b"\x10\x03\x10\x04"
    raw = grpc_frame(b"\x12" + bytes([len(tokenized)]) + tokenized)
    assert _parse(VLLM_GRPC, GEN_PATH, raw).token_ids == [3, 4]


def test_vllm_grpc_bad_frames_and_messages(pb: dict[str, ModuleType]) -> None:
    v = pb["vllm_engine"]
    good = v.GenerateRequest(text="x").SerializeToString()
    assert _bad(VLLM_GRPC, GEN_PATH, b"\x00\x00") == "invalid or unsupported gRPC payload"
    assert _bad(VLLM_GRPC, GEN_PATH, b"\x01" + grpc_frame(good)[1:]) == "invalid or unsupported gRPC payload"
    assert _bad(VLLM_GRPC, GEN_PATH, grpc_frame(good)[:-1]) == "invalid or unsupported gRPC payload"
    assert _bad(VLLM_GRPC, GEN_PATH, grpc_frame(b"\x12\x7f\x01")).startswith(
        "GenerateRequest is not a valid protobuf message: "
    )
    assert _bad(VLLM_GRPC, GEN_PATH, grpc_frame(v.GenerateRequest(stream=True).SerializeToString())) == (
        "not supported request inputType"
    )
    assert _bad(VLLM_GRPC, EMBED_PATH, grpc_frame(b"")) == "missing tokenized input in EmbedRequest"


def test_vllm_grpc_other_methods_are_routed_unread() -> None:
    body = _parse(VLLM_GRPC, "/vllm.grpc.engine.VllmEngine/GetModelInfo", grpc_frame(b""))
    assert body.api is ApiKind.RAW
    assert VLLM_GRPC.supported_app_protocols() == ("kubernetes.io/h2c",)


# --- vertexai-parser ------------------------------------------------------------------------------------

VERTEX_PREFIX = "/google.cloud.aiplatform.v1beta1.PredictionService/"
ENDPOINT = "projects/p/locations/us-central1/endpoints/openapi"


def _vertex(pb: dict[str, ModuleType], kind: str, data: bytes, *, with_body: bool = True) -> bytes:
    a = pb["vertexai_prediction"]
    cls = getattr(a, f"{kind}Request")
    msg = (
        cls(endpoint=ENDPOINT, http_body=a.HttpBody(content_type="application/json", data=data))
        if with_body
        else cls(endpoint=ENDPOINT)
    )
    return grpc_frame(msg.SerializeToString())


def test_vertex_chat_completions(pb: dict[str, ModuleType]) -> None:
    chat = {"model": "google/gemma-3", "messages": [{"role": "user", "content": "Hello"}], "stream": True}
    raw = _vertex(pb, "ChatCompletions", json.dumps(chat).encode())
    body = _parse(VERTEX, VERTEX_PREFIX + "ChatCompletions", raw, **GRPC_HEADERS)
    assert body.api is ApiKind.CHAT_COMPLETIONS
    assert body.payload["model"] == "google/gemma-3"  # the model comes from the embedded JSON
    assert body.stream and not body.rewritable and body.raw == raw
    assert "Hello" in body.prompt_text


@pytest.mark.parametrize("kind", ["RawPredict", "StreamRawPredict"])
def test_vertex_raw_predicts_carry_responses_bodies(pb: dict[str, ModuleType], kind: str) -> None:
    raw = _vertex(pb, kind, b'{"input":"Hello from raw predict"}')
    body = _parse(VERTEX, VERTEX_PREFIX + kind, raw, **GRPC_HEADERS)
    assert body.api is ApiKind.RESPONSES
    assert "Hello from raw predict" in body.prompt_text
    assert "model" not in body.payload


def test_vertex_bad_requests(pb: dict[str, ModuleType]) -> None:
    path = VERTEX_PREFIX + "ChatCompletions"
    assert "invalid or unsupported gRPC payload: invalid gRPC frame" in _bad(
        VERTEX, path, b"\x00\x00\x00\x00"
    )
    assert _bad(VERTEX, path, b"\x00\x00\x00\x00\x01\xff").startswith(
        "ChatCompletionsRequest is not a valid protobuf message: "
    )
    assert _bad(VERTEX, path, _vertex(pb, "ChatCompletions", b"", with_body=False)) == (
        "ChatCompletionsRequest has no HttpBody"
    )
    message = _bad(VERTEX, path, _vertex(pb, "ChatCompletions", b'{"model":"m"}'))
    assert (
        message
        == "parsing ChatCompletionsRequest: invalid chat completions request: must have valid messages field"
    )


def test_vertex_other_methods_are_routed_unread() -> None:
    body = _parse(VERTEX, VERTEX_PREFIX + "Predict", b"")
    assert body.api is ApiKind.RAW and not body.rewritable


# --- openai-parser additions -------------------------------------------------------------------------------


def test_openai_images_generations() -> None:
    body = _parse(
        OPENAI,
        "/v1/images/generations",
        {"model": "flux", "prompt": "a red fox", "n": 1, "size": "1024x1024"},
    )
    assert body.api is ApiKind.IMAGES_GENERATIONS and body.prompt_text == "a red fox"
    assert _bad(OPENAI, "/v1/images/generations", {"model": "flux"}) == (
        "invalid images generations request: must have prompt field"
    )


def test_openai_render_paths() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert _parse(OPENAI, "/v1/chat/completions/render", chat).api is ApiKind.CHAT_COMPLETIONS
    assert _parse(OPENAI, "/v1/completions/render", {"model": "m", "prompt": "x"}).api is ApiKind.COMPLETIONS
