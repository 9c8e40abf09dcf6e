"""``token-producer``: configuration, the estimate backend, the vllm render backend against a real
HTTP server on 127.0.0.1 (answers, failures, cache, one connection pool), the local backend, and the
plugins that count exact tokens when a prompt is tokenized."""

from __future__ import annotations

import asyncio
import base64
import socket
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from epp.datalayer.store import EndpointStore
from epp.dev.sim.engine import SimConfig
from epp.dev.sim.server import SimServer
from epp.framework import ApiKind, DataProducer, LLMRequest, RequestBody, register, registry
from epp.framework.attributes import DEFAULT_PRODUCERS, TOKENIZED_PROMPT_KEY, TokenizedPrompt
from epp.framework.results import CycleState
from epp.plugins.deciders.prefix_based import estimate_input_tokens as pd_input_tokens
from epp.plugins.producers import inflight_load
from epp.plugins.producers._render_client import RENDER_CACHE, RENDER_FAILURES
from epp.plugins.producers._token_estimate import Estimator, pack
from epp.plugins.producers.token_producer import TokenProducer
from epp.plugins.scorers.context_length_aware import request_length
from epp.server.director import Director, DirectorHooks
from tests.unit.factories import chat, completions, config, config_error, metadata, request
from tests.unit.polling import until

# --- helpers ------------------------------------------------------------------------------------------


def _producer(yaml_params: str = "", name: str = "tp") -> TokenProducer:
    body = "plugins:\n- type: token-producer\n  name: " + name + "\n"
    if yaml_params:
        body += "  parameters:\n" + "".join(f"    {line}\n" for line in yaml_params.splitlines())
    cfg = config(body)
    p = cfg.plugins[name]
    assert isinstance(p, TokenProducer)
    return p


async def _produce(p: TokenProducer, req: LLMRequest) -> TokenizedPrompt | None:
    await p.produce(CycleState(), req, [])
    return req.body.tokenized


def _png(width: int, height: int) -> str:
    """A real (tiny-data) PNG's base64: signature, IHDR of the given size, an IDAT, IEND."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    raw = b"".join(b"\0" + b"\0" * width for _ in range(height))
    png = (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )
    return base64.b64encode(png).decode()


def _failures(plugin: str, reason: str) -> float:
    return RENDER_FAILURES.labels(plugin, reason).value


# --- configuration ------------------------------------------------------------------------------------


def test_default_is_the_estimate_backend() -> None:
    assert _producer().backend == "estimate"
    assert _producer("modelName: m").backend == "vllm"
    assert _producer("modelName: m\nvllm: {url: 'http://r:8000'}").backend == "vllm"


def test_vllm_defaults_and_produce_timeout() -> None:
    p = _producer("modelName: m")
    assert p._render is not None
    assert (p._render.base_url, p._render.timeout, p._render.mm_timeout) == (
        "http://localhost:8000",
        5.0,
        30.0,
    )
    assert p.produce_timeout == 30.0
    q = _producer("modelName: m\nvllm: {url: 'http://r:9/', timeout: 250ms, mmTimeout: 2s}")
    assert q._render is not None
    assert (q._render.base_url, q._render.timeout, q._render.mm_timeout) == ("http://r:9", 0.25, 2.0)


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        ("modelName: m\nudsTokenizerConfig: {socketFile: /tmp/t.sock}", "udsTokenizerConfig", "vllm"),
        ("estimate: {}\nmodelName: m", "vllm", "only one of"),
        ("estimate: {}\nlocal: {path: /x}", "local", "only one of"),
        ("vllm: {url: 'http://r:8000'}", "modelName", "must be specified"),
        ("modelName: m\nvllm: {timeout: fast}", "vllm.timeout", "positive duration"),
        ("modelName: m\nvllm: {mmTimeout: 0s}", "vllm.mmTimeout", "positive duration"),
        ("modelName: m\nvllm: {url: 'localhost:8000'}", "vllm.url", "http://"),
        ("estimate: {image: {mode: huge}}", "estimate.image.mode", '"dynamic" or "static"'),
        ("estimate: {video: {tokensPerFrame: {mode: x}}}", "estimate.video.tokensPerFrame.mode", "static"),
        (
            "estimate: {video: {frames: {mode: every}}}",
            "estimate.video.frames.mode",
            '"sampled" or "strided"',
        ),
        (
            "estimate: {video: {frames: {sampled: {sampleFps: 2}}}}",
            "estimate.video.frames.sampled",
            "unknown",
        ),
        ("local: {}", "local.path", "tokenizer.json"),
        (
            "estimate: {video: {defaultResolution: {width: 1, height: -2}}}",
            "estimate.video.defaultResolution.height",
            "non-negative",
        ),
        ("estimate: {image: {static: {staticToken: many}}}", "estimate.image.static.staticToken", "integer"),
    ],
)
def test_bad_parameters_name_the_field(params: str, field: str, reason: str) -> None:
    body = "plugins:\n- type: token-producer\n  parameters:\n" + "".join(
        f"    {line}\n" for line in params.splitlines()
    )
    err = config_error(body)
    assert err.field.startswith(f"plugins[0].parameters.{field}"), err
    assert reason in err.reason, err


def test_local_backend_with_a_missing_directory_is_refused(tmp_path: Any) -> None:
    err = config_error(
        f"plugins:\n- type: token-producer\n  parameters:\n    local: {{path: '{tmp_path / 'none'}'}}\n"
    )
    assert err.field.startswith("plugins[0].parameters.local"), err


def test_empty_uds_section_is_ignored_as_in_the_reference() -> None:
    assert _producer("udsTokenizerConfig: {}").backend == "estimate"


def test_effective_config_reloads_to_the_same_backend() -> None:
    cfg = config("plugins:\n- type: token-producer\n")
    again = config(cfg.effective_yaml().split("\n", 2)[2])
    p = again.plugins["token-producer"]
    assert isinstance(p, TokenProducer) and p.backend == "estimate"


def test_alias_loads_the_same_type_and_warns_once_naming_the_new_type() -> None:
    registry._WARNED.discard("tokenizer")
    cfg = config("plugins:\n- type: tokenizer\n")
    assert isinstance(cfg.plugins["tokenizer"], TokenProducer)
    warnings = [w for w in cfg.warnings if "'tokenizer' is deprecated" in w]
    assert len(warnings) == 1 and "use 'token-producer'" in warnings[0], cfg.warnings
    again = config("plugins:\n- type: tokenizer\n")
    assert not [w for w in again.warnings if "'tokenizer' is deprecated" in w]
    dep = registry.deprecation("tokenizer")
    assert dep is not None and dep.replacement == "token-producer"
    assert TokenProducer.stability.value == "beta"


class _Consumer(DataProducer):
    type_name = "test-tokenized-prompt-consumer"
    consumes = frozenset({TOKENIZED_PROMPT_KEY})

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Any]) -> None:
        return None


@pytest.fixture
def consumer_type() -> Any:
    register(_Consumer)
    yield _Consumer
    registry._REGISTRY.pop(_Consumer.type_name, None)


def test_a_consumer_without_a_producer_gets_the_estimate_producer(consumer_type: Any) -> None:
    assert DEFAULT_PRODUCERS[TOKENIZED_PROMPT_KEY] == "token-producer"
    cfg = config(f"plugins:\n- type: {consumer_type.type_name}\n")
    created = [p for p in cfg.plugins.values() if isinstance(p, TokenProducer)]
    assert len(created) == 1 and created[0].backend == "estimate"
    order = [p.type_name for p in cfg.producers]
    assert order.index("token-producer") < order.index(consumer_type.type_name)


def test_a_declared_producer_is_not_duplicated(consumer_type: Any) -> None:
    declared = "- type: token-producer\n  parameters: {modelName: m}\n"
    cfg = config(f"plugins:\n- type: {consumer_type.type_name}\n{declared}")
    created = [p for p in cfg.plugins.values() if isinstance(p, TokenProducer)]
    assert [p.backend for p in created] == ["vllm"]


# --- request-carried ids and idempotence ----------------------------------------------------------------


async def test_request_token_ids_are_exact_and_need_no_backend() -> None:
    p = _producer("modelName: m\nvllm: {url: 'http://127.0.0.1:9', timeout: 100ms}")
    body = RequestBody(ApiKind.GENERATE, {"token_ids": [5, 6, 7]}, b"", token_ids=[5, 6, 7])
    req = LLMRequest("r", body, {}, "m", "m")
    before = _failures("tp", "connect")
    tp = await _produce(p, req)
    assert tp is not None and list(tp.token_ids) == [5, 6, 7] and tp.exact
    assert _failures("tp", "connect") == before
    ids_prompt = await _produce(p, completions([9, 8]))
    assert ids_prompt is not None and list(ids_prompt.token_ids) == [9, 8] and ids_prompt.exact


async def test_an_already_tokenized_prompt_is_left_alone() -> None:
    p = _producer()
    req = completions("hello world")
    given = TokenizedPrompt([1, 2, 3])
    req.body.tokenized = given
    await p.produce(CycleState(), req, [])
    assert req.body.tokenized is given


# --- the estimate backend -------------------------------------------------------------------------------


async def test_estimate_packs_four_bytes_a_token() -> None:
    tp = await _produce(_producer(), completions("abcdefg"))
    assert tp is not None and not tp.exact
    assert list(tp.token_ids) == [int.from_bytes(b"abcd", "little"), int.from_bytes(b"efg\0", "little")]


async def test_estimate_is_deterministic_and_prefix_stable() -> None:
    p = _producer()
    shared = "You are a helpful assistant. " * 40
    a = await _produce(p, chat([{"role": "system", "content": shared}, {"role": "user", "content": "one"}]))
    b = await _produce(p, chat([{"role": "system", "content": shared}, {"role": "user", "content": "two!"}]))
    a2 = await _produce(p, chat([{"role": "system", "content": shared}, {"role": "user", "content": "one"}]))
    assert a is not None and b is not None and a2 is not None
    assert list(a.token_ids) == list(a2.token_ids)
    n = len(("system" + shared + "user").encode()) // 4
    assert list(a.token_ids)[:n] == list(b.token_ids)[:n]
    assert list(a.token_ids) != list(b.token_ids)


async def test_estimate_images_from_their_size_or_the_default() -> None:
    p = _producer()
    png = f"data:image/png;base64,{_png(64, 48)}"
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": png}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
            ],
        }
    ]
    tp = await _produce(p, chat(msgs))
    assert tp is not None
    (h1, off1, n1), (h2, off2, n2) = tp.mm_hashes
    assert n1 == 64 * 48 // 1024 and n2 == 640 * 360 // 1024
    assert off1 == len(b"userlook") // 4 and off2 == off1 + n1
    ids = list(tp.token_ids)
    assert len(set(ids[off1 : off1 + n1])) == 1 and len(set(ids[off2 : off2 + n2])) == 1
    assert h1 != h2
    static = _producer("estimate: {image: {mode: static, static: {staticToken: 7}}}")
    st = await _produce(static, chat(msgs))
    assert st is not None and [n for _, _, n in st.mm_hashes] == [7, 7]
    sized = _producer(
        "estimate: {image: {defaultResolution: {width: 100, height: 100}, dynamic: {factor: 100}}}"
    )
    sz = await _produce(sized, chat(msgs))
    assert sz is not None and [n for _, _, n in sz.mm_hashes] == [64 * 48 // 100, 100]


def _video_chat(headers: dict[str, str] | None = None) -> LLMRequest:
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://v/clip.mp4"}}]}]
    return chat(msgs, headers=headers)


async def test_estimate_videos_sampled_and_strided_with_headers() -> None:
    default = await _produce(_producer(), _video_chat())
    assert default is not None and default.mm_hashes[0][2] == 10 * 2 * (640 * 360 // 1024)
    qwen = _producer(
        "estimate: {video: {frames: {mode: sampled, sampled: {sampleFPS: 2, temporalPatchSize: 2}}}}"
    )
    hdr = {
        "x-llm-d-video-duration-seconds": "4",
        "x-llm-d-video-resolution": "320x320",
        "x-llm-d-video-fps": "60",
    }
    q = await _produce(qwen, _video_chat(hdr))
    assert q is not None and q.mm_hashes[0][2] == (4 * 2 // 2) * (
        320 * 320 // 1024
    )  # fps header: not sampled mode
    gemma = _producer(
        "estimate: {video: {tokensPerFrame: {mode: static, static: {numTokensPerFrame: 10}},"
        " frames: {mode: strided, maxFrames: 50, strided: {frameStride: 2}}, maxVideoTokens: 450}}"
    )
    g = await _produce(gemma, _video_chat({"x-llm-d-video-duration-seconds": "2", "x-llm-d-video-fps": "30"}))
    assert g is not None and g.mm_hashes[0][2] == (2 * 30 // 2) * 10
    capped = await _produce(gemma, _video_chat({"x-llm-d-video-duration-seconds": "100"}))
    assert capped is not None and capped.mm_hashes[0][2] == 450  # 50 frames x 10, capped at 450
    bad = await _produce(
        _producer(), _video_chat({"x-llm-d-video-duration-seconds": "nan?", "x-llm-d-video-resolution": "9"})
    )
    assert bad is not None and bad.mm_hashes[0][2] == default.mm_hashes[0][2]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.text(max_size=50), st.text(max_size=50))
def test_estimate_equal_text_prefixes_give_equal_id_prefixes(shared: str, a: str, b: str) -> None:
    est = Estimator(None)
    ids_a = list(est.estimate(completions(shared + a).body, {})[0])
    ids_b = list(est.estimate(completions(shared + b).body, {})[0])
    n = len(shared.encode("utf-8", "surrogatepass")) // 4
    assert ids_a[:n] == ids_b[:n]
    assert ids_a == list(est.estimate(completions(shared + a).body, {})[0])


def test_pack_pads_the_tail() -> None:
    assert list(pack(b"")) == []
    assert list(pack(b"\x01")) == [1]


# --- the vllm backend against a real HTTP server ------------------------------------------------------


@dataclass
class RenderServer:
    """A vLLM-like render server: ``mode`` picks the answer (ok, 500, badjson, stall)."""

    url: str = ""
    mode: str = "ok"
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    peers: set[Any] = field(default_factory=set)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    max_ids: int = 64

    @staticmethod
    def ids_of(body: dict[str, Any]) -> list[int]:
        text = orjson.dumps(body.get("messages", body.get("prompt")))
        return [b for b in text[:64]]

    async def handle(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.calls.append((req.path, body))
        self.peers.add(req.transport.get_extra_info("peername") if req.transport else None)
        if self.mode == "stall":
            await self.release.wait()
        if self.mode == "slow":
            await asyncio.sleep(0.2)
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        if self.mode == "badjson":
            return web.Response(text="{not json", content_type="application/json")
        if self.mode == "noids":
            return web.json_response({"request_id": "x"})
        ids = self.ids_of(body)[: self.max_ids]
        one = {
            "request_id": "r",
            "token_ids": ids,
            "features": None,
            "sampling_params": {},
            "model": body["model"],
        }
        if req.path == "/v1/completions/render":
            return web.json_response([one])
        if self.mode == "mm":
            one["features"] = {
                "mm_hashes": {"image": ["hb", "ha"]},
                "mm_placeholders": {"image": [{"offset": 9, "length": 3}, {"offset": 2, "length": 4}]},
            }
        return web.json_response(one)


@pytest.fixture
async def render_server() -> AsyncIterator[RenderServer]:
    srv = RenderServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions/render", srv.handle)
    app.router.add_post("/v1/completions/render", srv.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    srv.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield srv
    finally:
        srv.release.set()
        await runner.cleanup()


MakeProducer = Callable[..., Awaitable[TokenProducer]]


@pytest.fixture
async def vllm_producer(render_server: RenderServer) -> AsyncIterator[MakeProducer]:
    made: list[TokenProducer] = []

    async def make(name: str, timeout: str = "2s", url: str | None = None) -> TokenProducer:
        p = _producer(
            f"modelName: base/model\nvllm: {{url: '{url or render_server.url}', timeout: {timeout}}}", name
        )
        made.append(p)
        return p

    yield make
    for p in made:
        await p.close()


async def test_vllm_chat_render(render_server: RenderServer, vllm_producer: MakeProducer) -> None:
    p = await vllm_producer("v-chat")
    msgs = [{"role": "user", "content": "hi there"}]
    req = chat(msgs, model="served-alias")
    req.body.payload["max_tokens"] = 5
    tp = await _produce(p, req)
    assert tp is not None and tp.exact
    path, sent = render_server.calls[0]
    assert path == "/v1/chat/completions/render"
    assert sent["model"] == "base/model" and sent["messages"] == msgs and sent["max_tokens"] == 5
    assert list(tp.token_ids) == RenderServer.ids_of(sent)
    assert req.body.payload["model"] == "served-alias"  # the request itself is not changed


async def test_vllm_completions_render(render_server: RenderServer, vllm_producer: MakeProducer) -> None:
    p = await vllm_producer("v-cmpl")
    tp = await _produce(p, completions("Once upon a time"))
    assert tp is not None and tp.exact
    path, sent = render_server.calls[0]
    assert path == "/v1/completions/render" and sent["prompt"] == "Once upon a time"
    assert list(tp.token_ids) == RenderServer.ids_of(sent)


async def test_vllm_multimodal_features_sorted_by_offset(
    render_server: RenderServer, vllm_producer: MakeProducer
) -> None:
    render_server.mode = "mm"
    p = await vllm_producer("v-mm")
    tp = await _produce(p, chat([{"role": "user", "content": "x"}]))
    assert tp is not None and tp.mm_hashes == (("ha", 2, 4), ("hb", 9, 3))


async def test_vllm_anthropic_messages_are_rendered_as_chat(
    render_server: RenderServer, vllm_producer: MakeProducer
) -> None:
    p = await vllm_producer("v-msg")
    payload = {
        "model": "m",
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: 123"},
            {"type": "text", "text": "Be brief."},
        ],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {"d": "/"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a b"}]},
        ],
    }
    tp = await _produce(p, request(payload, api=ApiKind.MESSAGES))
    assert tp is not None
    path, sent = render_server.calls[0]
    assert path == "/v1/chat/completions/render"
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": '{"d": "/"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "a b"},
    ]


async def test_vllm_cache_reuses_a_render(render_server: RenderServer, vllm_producer: MakeProducer) -> None:
    p = await vllm_producer("v-cache")
    msgs = [{"role": "user", "content": "same prompt"}]
    hits = RENDER_CACHE.labels("v-cache", "hit").value
    first = await _produce(p, chat(msgs))
    retry = chat(msgs)
    retry.body.payload["temperature"] = 0.3  # sampling only: the same render
    second = await _produce(p, retry)
    assert first is not None and second is not None and list(first.token_ids) == list(second.token_ids)
    assert len(render_server.calls) == 1
    assert RENDER_CACHE.labels("v-cache", "hit").value == hits + 1
    await _produce(p, chat([{"role": "user", "content": "another prompt"}]))
    assert len(render_server.calls) == 2


async def test_vllm_concurrent_identical_renders_share_one_call(
    render_server: RenderServer, vllm_producer: MakeProducer
) -> None:
    render_server.mode = "slow"
    p = await vllm_producer("v-flight")
    reqs = [chat([{"role": "user", "content": "burst"}], request_id=f"r{i}") for i in range(5)]
    results = await asyncio.gather(*(_produce(p, r) for r in reqs))
    assert len(render_server.calls) == 1
    assert all(r is not None and list(r.token_ids) == list(results[0].token_ids) for r in results)  # type: ignore[union-attr]


async def test_vllm_requests_share_one_connection(
    render_server: RenderServer, vllm_producer: MakeProducer
) -> None:
    p = await vllm_producer("v-pool")
    for i in range(4):
        await _produce(p, completions(f"prompt {i}"))
    assert len(render_server.calls) == 4
    assert len(render_server.peers) == 1  # keep-alive: one pooled connection served all four


@pytest.mark.parametrize(("mode", "reason"), [("500", "status"), ("badjson", "decode"), ("noids", "decode")])
async def test_vllm_failures_give_no_tokens_and_are_counted(
    render_server: RenderServer, vllm_producer: MakeProducer, mode: str, reason: str
) -> None:
    render_server.mode = mode
    name = f"v-{mode}"
    p = await vllm_producer(name)
    before = _failures(name, reason)
    req = chat([{"role": "user", "content": "x"}])
    assert await _produce(p, req) is None
    assert _failures(name, reason) == before + 1
    render_server.mode = "ok"  # a failure is not cached: the next request renders
    assert await _produce(p, chat([{"role": "user", "content": "x"}])) is not None


async def test_vllm_stalled_server_times_out(
    render_server: RenderServer, vllm_producer: MakeProducer
) -> None:
    render_server.mode = "stall"
    p = await vllm_producer("v-stall", timeout="200ms")
    before = _failures("v-stall", "timeout")
    assert await asyncio.wait_for(_produce(p, completions("x")), 10) is None
    assert _failures("v-stall", "timeout") == before + 1


async def test_vllm_refused_connection(vllm_producer: MakeProducer) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = await vllm_producer("v-refused", url=f"http://127.0.0.1:{port}")
    before = _failures("v-refused", "connect")
    assert await _produce(p, completions("x")) is None
    assert _failures("v-refused", "connect") == before + 1


async def test_vllm_unsupported_api_is_skipped(
    render_server: RenderServer, vllm_producer: MakeProducer
) -> None:
    p = await vllm_producer("v-skip")
    assert await _produce(p, request({"model": "m", "input": "x"}, api=ApiKind.RESPONSES)) is None
    assert render_server.calls == []


async def test_director_routes_by_the_rendered_token_count(render_server: RenderServer) -> None:
    """Through the real director: the token-producer runs before the context-length filter, whose
    exact count (10 rendered ids) picks the short-context endpoint; the 4000-byte estimate would not."""
    render_server.max_ids = 10
    store = EndpointStore()
    label = "llm-d.ai/context-length-range"
    store.upsert(metadata("short", "10.0.0.1", labels={label: "0-100"}))
    store.upsert(metadata("long", "10.0.0.2", labels={label: "101-1000000"}))
    cfg = config(
        "plugins:\n"
        f"- type: token-producer\n  parameters: {{modelName: base, vllm: {{url: '{render_server.url}'}}}}\n"
        "- type: context-length-aware\n  parameters: {enableFiltering: true}\n"
        "- type: max-score-picker\n"
        "schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: context-length-aware\n"
        "  - pluginRef: max-score-picker\n"
    )
    director = Director(store, cfg.parsers, cfg.scheduler, DirectorHooks(cfg.producers))
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]})
    try:
        routing = await director.route({":path": "/v1/chat/completions"}, raw, {})
        assert routing.request is not None and routing.request.body.tokenized is not None
        assert len(routing.request.body.tokenized.token_ids) == 10
        assert routing.destination == "10.0.0.1:8000"
        assert len(render_server.calls) == 1
    finally:
        tp = cfg.plugins["token-producer"]
        assert isinstance(tp, TokenProducer)
        await tp.close()


# --- the local backend --------------------------------------------------------------------------------


async def test_local_backend_large_prompts_run_off_the_event_loop() -> None:
    import threading

    from epp.tokenization import DEFAULT_TOKENIZER_DIR

    p = _producer(f"local: {{path: '{DEFAULT_TOKENIZER_DIR}'}}")
    assert p.backend == "local" and p.produce_timeout == 5.0
    assert p._local is not None
    threads: list[str] = []

    class Recording:  # the real tokenizer, noting which thread encodes
        def __init__(self, tok: Any) -> None:
            self.tok = tok

        def __getattr__(self, name: str) -> Any:
            return getattr(self.tok, name)

        def encode_cached(self, text: str) -> list[int]:
            threads.append(threading.current_thread().name)
            return list(self.tok.encode_cached(text))

    p._local.tok = Recording(p._local.tok)
    big = "x" * (64 * 1024)
    req = chat([{"role": "user", "content": big}])
    req.body.raw = orjson.dumps(req.body.payload)
    tp = await _produce(p, req)
    small = await _produce(p, chat([{"role": "user", "content": "tiny"}]))
    assert tp is not None and small is not None
    assert threads[0].startswith("token-producer") and threads[1] == threading.current_thread().name
    assert p._local._busy == 0
    await p.close()


async def test_local_backend_with_the_shipped_tokenizer_matches_chat_ids() -> None:
    """The ids are the tokenizer's own ``chat_ids`` / ``prompt_ids`` (what ``epp sim`` computes)."""
    from epp import tokenization

    path = str(tokenization.DEFAULT_TOKENIZER_DIR)
    tok = tokenization.load_tokenizer(path)
    p = _producer(f"local: {{path: '{path}'}}")
    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "list files " * 50},
    ]
    tp = await _produce(p, chat(history))
    assert tp is not None and tp.exact and list(tp.token_ids) == tok.chat_ids(history)
    turn2 = [*history, {"role": "assistant", "content": "a b c"}, {"role": "user", "content": "more"}]
    tp2 = await _produce(p, chat(turn2))
    assert tp2 is not None and list(tp2.token_ids) == tok.chat_ids(turn2)
    c = await _produce(p, completions("Once upon a time"))
    assert c is not None and list(c.token_ids) == tok.prompt_ids("Once upon a time")
    await p.close()


# --- exact token counts in other plugins ----------------------------------------------------------------


def test_exact_tokens_replace_the_estimate_in_counting_plugins() -> None:
    req = chat([{"role": "user", "content": "x" * 400}])
    est_ctx, est_pd, est_inflight = (
        request_length(req),
        pd_input_tokens(req.body),
        inflight_load.estimate_input_tokens(req),
    )
    assert min(est_ctx, est_pd, est_inflight) >= 100  # ~4 bytes a token of 400+ bytes
    req.body.tokenized = TokenizedPrompt(list(range(7)), exact=False)
    assert (request_length(req), pd_input_tokens(req.body), inflight_load.estimate_input_tokens(req)) == (
        est_ctx,
        est_pd,
        est_inflight,
    )
    req.body.tokenized = TokenizedPrompt(list(range(7)))
    assert (request_length(req), pd_input_tokens(req.body), inflight_load.estimate_input_tokens(req)) == (
        7,
        7,
        7,
    )


async def test_a_render_server_without_scale_out_is_named_at_start(vllm_producer: MakeProducer) -> None:
    # vLLM 0.32 (and epp sim) answer 403 on the render endpoints unless started with --enable-scale-out
    sim = SimServer(SimConfig(port=0, time_scale=0.0, model="base/model"))
    await sim.start()
    try:
        p = await vllm_producer("tp", url=sim.url)
        with capture_logs() as logs:
            await p.start_serving()
            await until(lambda: any("--enable-scale-out" in e["event"] for e in logs))
            assert p._probe is not None
            tp = await _produce(p, chat([{"role": "user", "content": "hi"}], model="base/model"))
            assert tp is None  # refused: no token ids
        assert sum("--enable-scale-out" in e["event"] for e in logs) == 1
    finally:
        await p.stop_serving()
        await sim.stop()
