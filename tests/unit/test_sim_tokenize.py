"""The simulator's real token ids and vLLM's tokenizer endpoints (``/tokenize``, ``/detokenize``,
``/v1/completions/render``, ``/v1/chat/completions/render``), on real servers on 127.0.0.1.

Expected ids always come from :mod:`epp.tokenization` (the module the EPP uses too), so the
simulator and a local token producer agree by construction; the tests check that the simulator's
engine, usage and KV cache get exactly those ids.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from epp.dev.sim.cli import add_arguments, config_from_args
from epp.dev.sim.engine import SimConfig
from epp.dev.sim.server import SimServer
from epp.dev.sim.tokens import OUTPUT_TEXT
from epp.tokenization import DEFAULT_TOKENIZER_DIR, load_tokenizer

TOK = load_tokenizer(DEFAULT_TOKENIZER_DIR)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def _sim(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "port": 0,
        "time_scale": 0.0,
        "served_model_names": ("alias",),
        "enable_scale_out": True,  # as the stacks start them (vLLM's flags)
        "enable_prompt_tokens_details": True,
    } | overrides
    server = SimServer(SimConfig(**options))
    await server.start()
    return server


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await _sim()
    yield server
    await server.stop()


async def _post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


def _error(status: int, body: Any, expected: int) -> str:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == expected
    return str(body["error"]["message"])


# --------------------------------------------------------------------------- /tokenize, /detokenize


async def test_tokenize_prompt(sim: SimServer, session: aiohttp.ClientSession) -> None:
    status, body = await _post(
        session, f"{sim.url}/tokenize", {"model": "alias", "prompt": "Hello world, return None"}
    )
    assert status == 200
    ids = TOK.prompt_ids("Hello world, return None")
    assert body == {
        "count": len(ids),
        "max_model_len": sim.config.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    _, with_strs = await _post(
        session, f"{sim.url}/tokenize", {"prompt": "Hello world, return None", "return_token_strs": True}
    )
    assert with_strs["token_strs"] == TOK.token_strs(ids) and "Ġreturn" in with_strs["token_strs"]


async def test_tokenize_messages(sim: SimServer, session: aiohttp.ClientSession) -> None:
    _, body = await _post(session, f"{sim.url}/tokenize", {"messages": CHAT})
    assert body["tokens"] == TOK.chat_ids(CHAT) and body["count"] == len(body["tokens"])
    assert TOK.decode(body["tokens"]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    _, plain = await _post(session, f"{sim.url}/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert plain["tokens"] == TOK.chat_ids(CHAT, add_generation_prompt=False) != body["tokens"]
    _, tools = await _post(session, f"{sim.url}/tokenize", {"messages": CHAT, "tools": TOOLS})
    assert tools["tokens"] == TOK.chat_ids(CHAT, tools=TOOLS) and "<tools>" in TOK.decode(tools["tokens"])


async def test_continue_final_message_leaves_the_last_message_open(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    chat = [*CHAT, {"role": "assistant", "content": "Seven"}]
    _, body = await _post(session, f"{sim.url}/tokenize", {"messages": chat, "continue_final_message": True})
    assert TOK.decode(body["tokens"]).endswith("<|im_start|>assistant\nSeven")
    status, error = await _post(
        session,
        f"{sim.url}/tokenize",
        {"messages": chat, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert "Cannot set both" in _error(status, error, 400)


async def test_detokenize_round_trip_and_bad_ids(sim: SimServer, session: aiohttp.ClientSession) -> None:
    text = "Grüße, 世界! <|im_end|>"
    status, body = await _post(session, f"{sim.url}/detokenize", {"tokens": TOK.encode(text)})
    assert status == 200 and body == {"prompt": text}
    for bad in ([TOK.vocab_size], [-1], ["a"]):
        status, error = await _post(session, f"{sim.url}/detokenize", {"tokens": bad})
        assert "out of vocabulary" in _error(status, error, 400)
        assert error["error"]["param"] == "tokens"
    status, error = await _post(session, f"{sim.url}/detokenize", {"tokens": "abc"})
    _error(status, error, 400)


@pytest.mark.parametrize(
    "path", ["/tokenize", "/detokenize", "/v1/completions/render", "/v1/chat/completions/render"]
)
async def test_unknown_model_is_a_404_and_bad_bodies_are_400s(
    sim: SimServer, session: aiohttp.ClientSession, path: str
) -> None:
    body = {"model": "nope", "prompt": "x", "messages": CHAT, "tokens": [1]}
    status, error = await _post(session, f"{sim.url}{path}", body)
    assert "`nope` does not exist" in _error(status, error, 404)
    async with session.post(f"{sim.url}{path}", data=b"{not json") as resp:
        _error(resp.status, await resp.json(), 400)
    status, error = await _post(session, f"{sim.url}{path}", {"prompt": 3, "messages": "hi", "tokens": None})
    _error(status, error, 400)


# --------------------------------------------------------------------------- render


async def test_completions_render_returns_one_generate_request_per_prompt(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    body = {"model": "demo", "prompt": ["first prompt", "second"], "max_tokens": 7, "temperature": 0.5}
    status, rendered = await _post(session, f"{sim.url}/v1/completions/render", body)
    assert status == 200 and isinstance(rendered, list) and len(rendered) == 2
    assert [r["token_ids"] for r in rendered] == [TOK.prompt_ids("first prompt"), TOK.prompt_ids("second")]
    first = rendered[0]
    assert first["request_id"].startswith("cmpl-") and first["model"] == "demo"
    assert first["sampling_params"]["max_tokens"] == 7 and first["sampling_params"]["temperature"] == 0.5
    assert (first["features"], first["stream"], first["priority"]) == (None, False, 0)
    _, ids = await _post(session, f"{sim.url}/v1/completions/render", {"prompt": [5, 6, 7]})
    assert [r["token_ids"] for r in ids] == [[5, 6, 7]]  # token ids are taken as given


async def test_chat_render_returns_one_generate_request(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    status, rendered = await _post(
        session, f"{sim.url}/v1/chat/completions/render", {"messages": CHAT, "tools": TOOLS}
    )
    assert status == 200 and isinstance(rendered, dict)
    assert rendered["token_ids"] == TOK.chat_ids(CHAT, tools=TOOLS)
    assert rendered["request_id"].startswith("chatcmpl-")
    # no max_tokens: vLLM fills in the room left in the context
    assert rendered["sampling_params"]["max_tokens"] == sim.config.max_model_len - len(rendered["token_ids"])


async def test_rendered_ids_are_what_the_engine_and_its_kv_cache_get(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    system = {"role": "system", "content": "Answer questions about the Python standard library. " * 20}
    chat = [system, {"role": "user", "content": "What does functools.cache do?"}]
    _, rendered = await _post(session, f"{sim.url}/v1/chat/completions/render", {"messages": chat})
    ids = rendered["token_ids"]
    status, answer = await _post(
        session, f"{sim.url}/v1/chat/completions", {"messages": chat, "max_tokens": 2}
    )
    assert status == 200 and answer["usage"]["prompt_tokens"] == len(ids)
    # the same ids sent as a token prompt hit every full block the chat request left in the cache
    status, again = await _post(session, f"{sim.url}/v1/completions", {"prompt": ids, "max_tokens": 1})
    block = sim.config.block_size
    assert status == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // block * block > 0


async def test_long_multi_turn_chat_tokenizes_the_same_off_the_loop(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    turns = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"step {i}: " + "ls -la /tmp && cat log.txt\n" * 40,
        }
        for i in range(120)
    ]
    assert len(json.dumps(turns)) > 64 * 1024  # large enough for the worker-thread path
    _, body = await _post(session, f"{sim.url}/tokenize", {"messages": turns})
    assert body["tokens"] == TOK.encode(TOK.render_chat(turns))
    _, body = await _post(
        session, f"{sim.url}/tokenize", {"messages": [*turns, {"role": "user", "content": "next"}]}
    )
    assert body["tokens"] == TOK.encode(TOK.render_chat([*turns, {"role": "user", "content": "next"}]))


# --------------------------------------------------------------------------- errors and limits


async def test_max_model_len_is_enforced_in_tokens(session: aiohttp.ClientSession) -> None:
    sim = await _sim(max_model_len=16)
    try:
        long_prompt = "word " * 40
        assert len(TOK.prompt_ids(long_prompt)) >= 16
        status, error = await _post(session, f"{sim.url}/v1/completions", {"prompt": long_prompt})
        assert "longer than the maximum model length of 16" in _error(status, error, 400)
        status, error = await _post(
            session, f"{sim.url}/v1/completions", {"prompt": [1] * 10, "max_tokens": 7}
        )
        assert "maximum context length is 16 tokens" in _error(status, error, 400)
        status, ok = await _post(session, f"{sim.url}/v1/completions", {"prompt": [1] * 10, "max_tokens": 6})
        assert status == 200 and ok["usage"]["prompt_tokens"] == 10
        status, ok = await _post(session, f"{sim.url}/v1/completions", {"prompt": [1] * 10})
        assert status == 200 and ok["usage"]["completion_tokens"] == 6  # the default length fits the context
        status, error = await _post(
            session,
            f"{sim.url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": long_prompt}]},
        )
        _error(status, error, 400)
    finally:
        await sim.stop()


async def test_chat_errors_are_400s(sim: SimServer, session: aiohttp.ClientSession) -> None:
    url = f"{sim.url}/v1/chat/completions"
    for body, fragment in (
        ({"messages": [{"content": "no role"}]}, "string role"),
        ({"messages": CHAT, "chat_template": "{{ 1 }}"}, "trust-request-chat-template"),
        ({"messages": CHAT, "tools": "x"}, "tools must be a list"),
        ({"messages": CHAT, "add_generation_prompt": "yes"}, "add_generation_prompt must be a boolean"),
        ({"prompt": [TOK.vocab_size + 5]}, "out of vocabulary"),
    ):
        target = url if "messages" in body else f"{sim.url}/v1/completions"
        status, error = await _post(session, target, body)
        assert fragment in _error(status, error, 400), body


async def test_tokenizer_flag_loads_a_hf_directory(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    directory = tmp_path / "bos"
    shutil.copytree(DEFAULT_TOKENIZER_DIR, directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config |= {"bos_token": "<|endoftext|>", "add_bos_token": True}
    config["chat_template"] = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}x"
    )
    config_file.write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(
        parser.parse_args(["--port", "0", "--tokenizer", str(directory), "--max-model-len", "99"])
    )
    assert (cfg.tokenizer, cfg.max_model_len) == (str(directory), 99)
    sim = await _sim(tokenizer=str(directory))
    try:
        _, body = await _post(session, f"{sim.url}/tokenize", {"prompt": "hi"})
        assert body["tokens"] == [0, *TOK.encode("hi")]  # its BOS
        _, body = await _post(session, f"{sim.url}/tokenize", {"prompt": "hi", "add_special_tokens": False})
        assert body["tokens"] == TOK.encode("hi")
        status, error = await _post(session, f"{sim.url}/v1/chat/completions", {"messages": CHAT})
        assert "no system" in _error(status, error, 400)
    finally:
        await sim.stop()
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokenizer", str(tmp_path / "missing")])


# --------------------------------------------------------------------------- token-in generate APIs


async def test_vllm_generate_takes_token_ids_and_answers_token_ids(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    prompt = TOK.chat_ids(CHAT)
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 3}, "request_id": "abc"}
    status, answer = await _post(session, f"{sim.url}/inference/v1/generate", body)
    assert status == 200, answer
    [choice] = answer["choices"]
    assert choice["token_ids"] == TOK.encode(OUTPUT_TEXT)[:3] and choice["finish_reason"] == "length"
    assert answer["request_id"] == "generate-tokens-abc"
    assert answer["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 3,
        "total_tokens": len(prompt) + 3,
    }
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{sim.url}/inference/v1/generate", json=stream) as resp:
        events = [line[6:] for line in (await resp.text()).split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [i for c in chunks[:-1] for i in c["choices"][0]["token_ids"]] == TOK.encode(OUTPUT_TEXT)[:3]
    assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt)
    for bad in ({"token_ids": []}, {"token_ids": [TOK.vocab_size]}, {"token_ids": [1], "sampling_params": 3}):
        status, error = await _post(session, f"{sim.url}/inference/v1/generate", bad)
        _error(status, error, 400)


async def test_sglang_generate_takes_input_ids_or_text(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    text = "Summarise the design of the prefix cache in two sentences. " * 4
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
    status, answer = await _post(session, f"{sim.url}/generate", body)
    assert status == 200, answer
    assert answer["output_ids"] == TOK.encode(OUTPUT_TEXT)[:2]
    assert answer["text"] == TOK.decode(TOK.encode(OUTPUT_TEXT)[:2])
    meta = answer["meta_info"]
    assert meta["prompt_tokens"] == len(TOK.prompt_ids(text)) and meta["completion_tokens"] == 2
    assert meta["finish_reason"] == {"type": "length", "length": 2} and meta["cached_tokens"] == 0
    # the same prompt as ids: the engine's KV cache holds the blocks the text request left
    ids = TOK.prompt_ids(text)
    _, again = await _post(
        session, f"{sim.url}/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    )
    block = sim.config.block_size
    assert again["meta_info"]["cached_tokens"] == (len(ids) - 1) // block * block > 0
    status, error = await _post(session, f"{sim.url}/generate", {"sampling_params": {}})
    assert "input_ids or text" in _error(status, error, 400)
