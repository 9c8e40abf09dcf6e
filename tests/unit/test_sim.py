"""Tests of ``epp sim``, the simulated vLLM server: API shapes, streaming, live metrics, errors, headers.

Servers run for real on 127.0.0.1 with a free port. Where a request must stay in flight, it is made long
(many tokens or a huge inter-token latency) and the test disconnects it; state changes are awaited by
polling ``/metrics`` with a generous bound, never by asserting on durations.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from epp.dev.sim.app import build_app
from epp.dev.sim.cli import add_arguments, config_from_args, serve
from epp.dev.sim.engine import Engine, QueueFullError, RequestSpec, SeqState, SimConfig
from epp.dev.sim.server import SimServer
from epp.dev.sim.tokens import OUTPUT_TEXT
from epp.dev.stack import free_ports
from epp.tokenization import DEFAULT_TOKENIZER_DIR, load_tokenizer

StartSim = Callable[..., Awaitable[SimServer]]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

LONG = 100_000  # max_tokens of a request that the test itself ends by disconnecting
POLL_BOUND_S = 10.0
TOK = load_tokenizer(DEFAULT_TOKENIZER_DIR)  # the simulator's default tokenizer


def prompt_len(text: str) -> int:
    return len(TOK.prompt_ids(text))


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    servers: list[SimServer] = []

    async def start(**overrides: Any) -> SimServer:
        options: dict[str, Any] = {
            "port": 0,
            "time_to_first_token": 0.0,
            "prefill_time_per_token": 0.0,
            "inter_token_latency": 0.0,
            "enable_prompt_tokens_details": True,  # as the stacks start it (vLLM's flags)
            "enable_scale_out": True,
        } | overrides
        server = SimServer(SimConfig(**options))
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


# --------------------------------------------------------------------------- helpers


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float:
    wanted = {"model_name": "demo", **labels}
    matches = [
        value for (n, lab), value in samples.items() if n == name and wanted.items() <= dict(lab).items()
    ]
    assert len(matches) == 1, f"{name}{labels}: {matches}"
    return matches[0]


async def wait_for_metrics(
    session: aiohttp.ClientSession, url: str, condition: Callable[[Samples], bool]
) -> Samples:
    """Poll /metrics until ``condition`` holds (bounded, so a broken engine fails instead of hanging)."""
    samples = await scrape(session, url)
    deadline = asyncio.get_running_loop().time() + POLL_BOUND_S
    while not condition(samples):
        assert asyncio.get_running_loop().time() < deadline, f"condition never held; last scrape: {samples}"
        await asyncio.sleep(0.01)
        samples = await scrape(session, url)
    return samples


def queue_is(running: int, waiting: int) -> Callable[[Samples], bool]:
    def check(samples: Samples) -> bool:
        return (
            metric(samples, "vllm:num_requests_running") == running
            and metric(samples, "vllm:num_requests_waiting") == waiting
        )

    return check


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events), events
    return [event.removeprefix("data: ") for event in events]


async def open_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> aiohttp.ClientResponse:
    """Start a streaming request and return once its first chunk has arrived (so it is running)."""
    resp = await session.post(f"{url}{path}", json=body | {"stream": True})
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    return resp


async def started_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> aiohttp.ClientResponse:
    """Start a streaming request and return once its headers arrived (it may still be waiting)."""
    resp = await session.post(f"{url}/v1/completions", json=body | {"stream": True})
    assert resp.status == 200
    return resp


def assert_openai_error(body: dict[str, Any], code: int) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]


# --------------------------------------------------------------------------- completions API


async def test_completion_usage_model_and_length(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    sim = await start_sim(served_model_names=("alias",))
    body = {"model": "alias", "prompt": "zqxjzqxjz", "max_tokens": 3}
    async with session.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["model"] == "alias"
    [choice] = data["choices"]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str) and choice["text"]
    assert data["usage"] == {
        "prompt_tokens": prompt_len("zqxjzqxjz"),
        "completion_tokens": 3,
        "total_tokens": prompt_len("zqxjzqxjz") + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_without_max_tokens_uses_default_length(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim(max_tokens=7)
    async with session.post(f"{sim.url}/v1/completions", json={"prompt": [1, 2, 3, 4, 5]}) as resp:
        data = await resp.json()
    assert data["model"] == "demo"
    assert data["usage"]["prompt_tokens"] == 5  # token ids are counted one by one
    assert data["usage"]["completion_tokens"] == 7
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_chat_honours_max_completion_tokens(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    messages = [
        {"role": "system", "content": "abcd"},
        {"role": "user", "content": [{"type": "text", "text": "efgh"}]},
    ]
    body = {"model": "demo", "messages": messages, "max_completion_tokens": 4, "max_tokens": 9}
    async with session.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "chat.completion"
    [choice] = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    rendered = "<|im_start|>system\nabcd<|im_end|>\n<|im_start|>user\nefgh<|im_end|>\n<|im_start|>assistant\n"
    assert data["usage"]["prompt_tokens"] == len(TOK.encode(rendered))  # the ChatML template's text
    assert data["usage"]["completion_tokens"] == 4
    assert data["usage"]["total_tokens"] == len(TOK.encode(rendered)) + 4


async def test_streaming_completion_chunks_and_usage(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    body = {
        "prompt": "qwertyuiop",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-inference-port"] == str(sim.port)
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) == 5
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None, None, None, None, "length"]
    assert all(c["choices"][0]["text"] for c in token_chunks)
    streamed = "".join(c["choices"][0]["text"] for c in token_chunks)
    assert streamed == TOK.decode(TOK.encode(OUTPUT_TEXT)[:5])  # real text, decoded from the token ids
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_len("qwertyuiop"),
        "completion_tokens": 5,
        "total_tokens": prompt_len("qwertyuiop") + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_streaming_chat_without_usage(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    sim = await start_sim(served_model_names=("other",))
    body = {
        "model": "other",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    async with session.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert {chunk["model"] for chunk in chunks} == {"other"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    contents = [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:]]
    assert len(contents) == 2 and all(contents)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in chunk for chunk in chunks)


# --------------------------------------------------------------------------- live metrics


async def test_running_and_waiting_metrics_follow_requests(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim(max_num_seqs=1, inter_token_latency=5.0)
    first = await open_stream(session, sim.url, {"prompt": "long", "max_tokens": LONG})
    second = asyncio.create_task(
        session.post(f"{sim.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    )
    samples = await wait_for_metrics(session, sim.url, queue_is(running=1, waiting=1))
    assert metric(samples, "vllm:kv_cache_usage_perc") > 0
    assert not second.done()

    first.close()  # client disconnect: the slot must pass to the waiting request
    async with await second as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 2
    samples = await wait_for_metrics(session, sim.url, queue_is(running=0, waiting=0))
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0
    assert (
        metric(samples, "vllm:request_success_total", finished_reason="length") == 1
    )  # the dropped one is not


async def test_metrics_return_to_zero_after_completion(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim(max_num_seqs=2)
    bodies = [{"prompt": "a" * 40, "max_tokens": 3}, {"prompt": "b" * 8, "max_tokens": 1, "stream": True}]
    for body in bodies * 2:
        async with session.post(f"{sim.url}/v1/completions", json=body) as resp:
            await resp.read()
    samples = await scrape(session, sim.url)
    assert metric(samples, "vllm:num_requests_running") == 0
    assert metric(samples, "vllm:num_requests_waiting") == 0
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0
    lengths = (prompt_len("a" * 40), prompt_len("b" * 8))
    prompt_tokens = sum(lengths)
    assert metric(samples, "vllm:prompt_tokens_total") == 2 * prompt_tokens
    assert metric(samples, "vllm:generation_tokens_total") == 2 * (3 + 1)
    assert metric(samples, "vllm:request_success_total", finished_reason="length") == 4
    assert metric(samples, "vllm:request_success_total", finished_reason="stop") == 0
    assert metric(samples, "vllm:prefix_cache_queries_total") == 2 * prompt_tokens
    # the second round repeats each prompt: its full 16-token blocks hit (never the last token)
    assert metric(samples, "vllm:prefix_cache_hits_total") == sum((n - 1) // 16 * 16 for n in lengths)


@pytest.mark.parametrize("fault", ["error", "hang", "garbage"])
async def test_metrics_fault_breaks_only_the_metrics_page(
    start_sim: StartSim, session: aiohttp.ClientSession, fault: str
) -> None:
    sim = await start_sim(metrics_fault=fault)
    if fault == "hang":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                async with session.get(f"{sim.url}/metrics") as resp:
                    await resp.read()
    else:
        async with session.get(f"{sim.url}/metrics") as resp:
            body = await resp.read()
        assert resp.status == (500 if fault == "error" else 200)
        assert b"vllm:" not in body
        if fault == "garbage":
            with pytest.raises(ValueError):
                list(text_string_to_metric_families(body.decode("latin-1")))
    async with session.post(f"{sim.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}) as resp:
        assert resp.status == 200  # inference still works


async def test_disconnect_while_waiting_frees_the_queue(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim(max_num_seqs=1, inter_token_latency=5.0)
    running = await open_stream(session, sim.url, {"prompt": "a", "max_tokens": LONG})
    waiting = await started_request(session, sim.url, {"prompt": "b", "max_tokens": LONG})
    await wait_for_metrics(session, sim.url, queue_is(running=1, waiting=1))
    waiting.close()
    await wait_for_metrics(session, sim.url, queue_is(running=1, waiting=0))
    running.close()
    samples = await wait_for_metrics(session, sim.url, queue_is(running=0, waiting=0))
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0


async def test_disconnect_releases_slot_without_handler_cancellation(session: aiohttp.ClientSession) -> None:
    """Embedded in a runner that does not cancel handlers, a dropped stream is noticed on its next write."""
    config = SimConfig(port=0, max_num_seqs=1, time_to_first_token=0.0, inter_token_latency=5.0)
    runner = web.AppRunner(build_app(config), handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        stream = await open_stream(session, url, {"prompt": "a", "max_tokens": LONG})
        await wait_for_metrics(session, url, queue_is(running=1, waiting=0))
        stream.close()
        await wait_for_metrics(session, url, queue_is(running=0, waiting=0))
    finally:
        await runner.cleanup()


async def test_kv_cache_usage_is_running_blocks_over_capacity(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    # 10 blocks of 10 tokens; prompts of 10 and 70 token ids; the second output token never comes.
    sim = await start_sim(kv_cache_size=10, block_size=10, inter_token_latency=3_600_000.0)
    stream = await open_stream(session, sim.url, {"prompt": [80] * 10, "max_tokens": 5})
    samples = await scrape(session, sim.url)
    assert metric(samples, "vllm:kv_cache_usage_perc") == pytest.approx(2 / 10)  # 11 tokens: 2 blocks
    big = await open_stream(session, sim.url, {"prompt": [81] * 70, "max_tokens": 5})
    samples = await scrape(session, sim.url)
    assert metric(samples, "vllm:kv_cache_usage_perc") == pytest.approx(10 / 10)  # 2 + 8 blocks
    stream.close()
    big.close()
    samples = await wait_for_metrics(session, sim.url, queue_is(running=0, waiting=0))
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0  # cached blocks stay but are not in use


async def test_info_metrics(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    sim = await start_sim(kv_cache_size=77, block_size=32, max_loras=3)
    samples = await scrape(session, sim.url)
    (cache,) = [
        dict(lab) for (n, lab), value in samples.items() if n == "vllm:cache_config_info" and value == 1
    ]
    assert (cache["block_size"], cache["num_gpu_blocks"], cache["engine"]) == ("32", "77", "0")
    assert len(cache) == 37 and "model_name" not in cache  # vLLM 0.32 CacheConfig fields, engine
    lora = metric(
        samples, "vllm:lora_requests_info", max_lora="3", running_lora_adapters="", waiting_lora_adapters=""
    )
    assert lora > 1_000_000_000  # a Unix timestamp


async def test_lora_residency_metrics(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    sim = await start_sim(lora_modules=["a", "b"], max_loras=1, max_cpu_loras=2)
    for name in ("a", "b"):
        async with session.post(f"{sim.url}/v1/completions", json={"model": name, "prompt": "hi"}) as resp:
            assert resp.status == 200
    samples = await scrape(session, sim.url)
    assert metric(samples, "vllm:lora_adapter_loaded", adapter_name="b", level="gpu", pinned="false") == 1
    assert metric(samples, "vllm:lora_adapter_loaded", adapter_name="a", level="cpu", pinned="false") == 1
    assert metric(samples, "vllm:num_gpu_loaded_lora_adapters") == 1
    assert metric(samples, "vllm:num_cpu_loaded_lora_adapters") == 1
    assert metric(samples, "vllm:max_gpu_lora_adapters") == 1
    assert metric(samples, "vllm:lora_adapter_load_seconds_count") == 2


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("path", "payload", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"model": "demo"}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "demo"}', 400, "messages"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
        (
            "/v1/chat/completions",
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model",
        ),
        ("/v1/unknown", b"{}", 404, None),
    ],
)
async def test_errors_are_openai_shaped(
    start_sim: StartSim,
    session: aiohttp.ClientSession,
    path: str,
    payload: bytes,
    status: int,
    param: str | None,
) -> None:
    sim = await start_sim(name="pod-e", namespace="ns-e")
    async with session.post(f"{sim.url}{path}", data=payload) as resp:
        assert resp.status == status
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.headers["x-inference-pod"] == "pod-e"
        assert resp.headers["x-inference-namespace"] == "ns-e"
        body = await resp.json()
    assert_openai_error(body, status)
    assert body["error"]["param"] == param


async def test_queue_cap_answers_429(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    sim = await start_sim(max_num_seqs=1, max_waiting=1, inter_token_latency=5.0)
    running = await open_stream(session, sim.url, {"prompt": "a", "max_tokens": LONG})
    waiting = await started_request(session, sim.url, {"prompt": "b", "max_tokens": LONG})
    await wait_for_metrics(session, sim.url, queue_is(running=1, waiting=1))
    async with session.post(f"{sim.url}/v1/completions", json={"prompt": "c", "stream": True}) as resp:
        assert resp.status == 429
        assert resp.headers["x-inference-port"] == str(sim.port)
        assert_openai_error(await resp.json(), 429)
    samples = await scrape(session, sim.url)
    assert metric(samples, "vllm:num_requests_waiting") == 1  # the rejected request never queued
    running.close()
    waiting.close()
    await wait_for_metrics(session, sim.url, queue_is(running=0, waiting=0))


# --------------------------------------------------------------------------- headers, models, debug


async def test_identity_headers_default_to_port(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    first, second = await start_sim(), await start_sim()
    for sim in (first, second):
        async with session.get(f"{sim.url}/health") as resp:
            assert resp.status == 200
            assert resp.headers["x-inference-pod"] == f"sim-{sim.port}"
            assert resp.headers["x-inference-port"] == str(sim.port)
            assert resp.headers["x-inference-namespace"] == "default"
    assert first.port != second.port


async def test_models_lists_every_served_name(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    sim = await start_sim(model="base", served_model_names=("a", "b"))
    async with session.get(f"{sim.url}/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    assert [model["id"] for model in data["data"]] == ["base", "a", "b"]
    assert {model["object"] for model in data["data"]} == {"model"}


async def test_debug_requests_records_bytes_verbatim(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    raw = '{ "prompt" :  "héllo\\n wörld",\n"max_tokens":1 ,"extra": [ 1,2 ] }'.encode()
    headers = {"Content-Type": "application/json", "X-Custom-Header": "Value-1"}
    async with session.post(f"{sim.url}/v1/completions?trace=1", data=raw, headers=headers) as resp:
        assert resp.status == 200
    async with session.post(f"{sim.url}/v1/chat/completions", data=b"{oops") as resp:
        assert resp.status == 400
    async with session.get(f"{sim.url}/debug/requests") as resp:
        entries = await resp.json()
    assert [entry["path"] for entry in entries] == ["/v1/completions?trace=1", "/v1/chat/completions"]
    assert entries[0]["body"].encode() == raw
    assert entries[0]["headers"]["x-custom-header"] == "Value-1"
    assert entries[0]["headers"]["content-type"] == "application/json"
    assert entries[1]["body"] == "{oops"

    async with session.delete(f"{sim.url}/debug/requests") as resp:
        assert resp.status == 200
    async with session.get(f"{sim.url}/debug/requests") as resp:
        assert await resp.json() == []


async def test_debug_requests_keeps_the_last_hundred(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    for i in range(105):
        async with session.post(
            f"{sim.url}/v1/completions", json={"prompt": f"n{i}", "max_tokens": 1}
        ) as resp:
            await resp.read()
    async with session.get(f"{sim.url}/debug/requests") as resp:
        entries = await resp.json()
    assert len(entries) == 100
    assert orjson.loads(entries[0]["body"])["prompt"] == "n5"
    assert orjson.loads(entries[-1]["body"])["prompt"] == "n104"


# --------------------------------------------------------------------------- engine


async def test_engine_is_fifo_and_capped() -> None:
    engine = Engine(SimConfig(max_num_seqs=1, max_waiting=2))
    seqs = [engine.submit(RequestSpec(f"r{i}", "demo", prompt_tokens=1)) for i in range(3)]
    assert [seq.state for seq in seqs] == [SeqState.RUNNING, SeqState.WAITING, SeqState.WAITING]
    with pytest.raises(QueueFullError):
        engine.submit(RequestSpec("r3", "demo", prompt_tokens=1))
    engine.abort(seqs[0])
    engine.abort(seqs[0])  # idempotent
    assert [seq.state for seq in seqs] == [SeqState.FINISHED, SeqState.RUNNING, SeqState.WAITING]
    engine.abort(seqs[2])  # leaving the queue does not disturb the running one
    assert (engine.snapshot().running, engine.snapshot().waiting) == (1, 0)
    engine.abort(seqs[1])
    assert (engine.snapshot().running, engine.snapshot().waiting) == (0, 0)


async def test_engine_cancelled_consumer_releases_slot() -> None:
    engine = Engine(SimConfig(max_num_seqs=1, time_to_first_token=0.0, inter_token_latency=3_600_000.0))
    seq = engine.submit(RequestSpec("r", "demo", prompt_tokens=4, max_tokens=10))
    first_token = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.tokens(seq):
            first_token.set()

    task = asyncio.create_task(consume())
    await first_token.wait()
    assert engine.snapshot().running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.snapshot().running == 0
    assert engine.snapshot().kv_cache_usage == 0


def test_config_rejects_invalid_values() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SimConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig(time_scale=-1)


# --------------------------------------------------------------------------- CLI


def test_cli_defaults_match_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])) == SimConfig()
    args = parser.parse_args(
        ["--port", "0", "--served-model-name", "a", "b", "--max-num-seqs", "2", "--time-scale", "0.5"]
    )
    config = config_from_args(args)
    assert config.served_model_names == ("a", "b")
    assert (config.port, config.max_num_seqs, config.time_scale) == (0, 2, 0.5)


@pytest.mark.parametrize("argv", [["--max-num-seqs", "0"], ["--time-scale", "-1"], ["--port", "70000"]])
def test_cli_rejects_bad_values(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)


async def test_serve_returns_when_stopped() -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(SimConfig(port=0), stop))
    await asyncio.sleep(0)
    stop.set()
    await asyncio.wait_for(task, POLL_BOUND_S)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_main_stops_cleanly_on_sigterm(session: aiohttp.ClientSession) -> None:
    script = (
        "import argparse, sys\n"
        "from epp.dev.sim.cli import add_arguments, main\n"
        "parser = argparse.ArgumentParser()\n"
        "add_arguments(parser)\n"
        "sys.exit(main(parser.parse_args(sys.argv[1:])))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        url = await asyncio.wait_for(_logged_url(proc.stdout), POLL_BOUND_S)
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), POLL_BOUND_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _logged_url(stdout: asyncio.StreamReader) -> str:
    """The URL in the simulator's start-up log line."""
    while line := await stdout.readline():
        if match := re.search(rb"url=(http://[\w.:\[\]]+)", line):
            return match.group(1).decode()
    raise AssertionError("the simulator exited without logging its URL")


# --------------------------------------------------------------------------- side ports


async def test_metrics_port_and_dcgm_port(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    metrics_port, dcgm_port = free_ports(2)
    sim = await start_sim(
        max_num_seqs=4, inter_token_latency=5.0, metrics_port=metrics_port, dcgm_port=dcgm_port
    )
    async with session.get(f"{sim.url}/metrics") as resp:
        assert resp.status in (404, 405)  # not served on the serving port, only on the metrics port
    side = f"http://127.0.0.1:{metrics_port}"
    running = await open_stream(session, sim.url, {"prompt": "a", "max_tokens": LONG})
    await wait_for_metrics(session, side, queue_is(running=1, waiting=0))
    async with session.get(f"http://127.0.0.1:{dcgm_port}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "DCGM_FI_DEV_GPU_UTIL"]
    (sample,) = family.samples
    assert sample.value == 25.0  # 1 of 4 sequences
    assert sample.labels["pod"] == f"sim-{sim.port}"
    running.close()


# --------------------------------------------------------------------------- vLLM 0.32's behaviours


async def _idle_connection_closed_after(port: int, wait: float) -> bool:
    """One request on a keep-alive connection, then ``wait`` s idle: has the server closed it?"""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: sim\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
        )
        await reader.readexactly(length)
        try:
            return await asyncio.wait_for(reader.read(1), wait) == b""
        except TimeoutError:
            return False
    finally:
        writer.close()


async def test_idle_connections_are_closed_after_the_keep_alive(start_sim: StartSim) -> None:
    assert SimConfig().keep_alive == 5.0  # vLLM's uvicorn
    sim = await start_sim(keep_alive=0.3)
    assert await _idle_connection_closed_after(sim.port, 3.0)
    sim = await start_sim(keep_alive=30.0)
    assert not await _idle_connection_closed_after(sim.port, 1.0)


async def test_prompt_tokens_details_only_with_the_flag(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    for flag, details in ((False, None), (True, {"cached_tokens": 0})):
        sim = await start_sim(enable_prompt_tokens_details=flag)
        async with session.post(f"{sim.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert (await r.json())["usage"]["prompt_tokens_details"] == details
    assert SimConfig().enable_prompt_tokens_details is False  # vLLM's default


@pytest.mark.parametrize(
    "path", ["/v1/completions/render", "/v1/chat/completions/render", "/inference/v1/generate"]
)
async def test_render_and_token_in_answer_403_without_scale_out(
    path: str, start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    assert SimConfig().enable_scale_out is False  # vLLM 0.32's default
    sim = await start_sim(enable_scale_out=False)
    async with session.post(f"{sim.url}{path}", json={"prompt": "hi"}) as r:
        assert r.status == 403
        error = (await r.json())["error"]
    assert "--enable-scale-out" in error["message"] and error["type"] == "PermissionDeniedError"


async def test_vllm_0_32_metric_families(start_sim: StartSim, session: aiohttp.ClientSession) -> None:
    sim = await start_sim(block_size=4)
    prompt = "the same long prompt " * 8
    for _ in range(2):
        async with session.post(f"{sim.url}/v1/completions", json={"prompt": prompt, "max_tokens": 3}) as r:
            assert r.status == 200
    samples = await scrape(session, sim.url)
    assert (
        metric(samples, "vllm:prompt_tokens_cached_total")
        == metric(samples, "vllm:prefix_cache_hits_total")
        > 0
    )
    assert metric(samples, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert metric(samples, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert metric(samples, "vllm:num_preemptions_total") == 0
    for phase in (
        "e2e_request_latency",
        "request_inference_time",
        "request_prefill_time",
        "request_decode_time",
    ):
        assert metric(samples, f"vllm:{phase}_seconds_count") == 2, phase
        assert metric(samples, f"vllm:{phase}_seconds_bucket", le="+Inf") == 2, phase
