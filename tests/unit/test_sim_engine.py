"""Tests of the vLLM-like model inside ``epp sim``: KV blocks and prefix caching, latency, LoRA, P/D, DP.

Engine-level tests run with ``time_scale=0`` (every sleep is zero) and compare the *modelled* values the
engine keeps on each sequence (``ttft_ms``, ``cached_tokens``, ``uncached_tokens``), never wall-clock
durations. HTTP-level tests run real servers on 127.0.0.1 with free ports.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.dev.sim.cli import add_arguments, config_from_args
from epp.dev.sim.engine import Engine, RequestSpec, SeqState, Sequence, SimConfig
from epp.dev.sim.kvcache import KVCache, PromptBlocks
from epp.dev.sim.latency import LatencyModel
from epp.dev.sim.lora import FROM_DISK, RESIDENT, LoraSlots
from epp.dev.sim.openai import parse_request
from epp.dev.sim.server import SimCluster, SimServer, rank_configs
from epp.tokenization import DEFAULT_TOKENIZER_DIR, load_tokenizer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
TOK = load_tokenizer(DEFAULT_TOKENIZER_DIR)  # the simulator's default tokenizer


def config(**overrides: Any) -> SimConfig:
    """A config with round numbers and no real sleeping."""
    options: dict[str, Any] = {
        "time_scale": 0.0,
        "time_to_first_token": 10.0,
        "prefill_time_per_token": 1.0,
        "inter_token_latency": 2.0,
        "block_size": 4,
        "kv_cache_size": 100,
        "enable_prompt_tokens_details": True,  # as the stacks start it (vLLM's flag)
    } | overrides
    return SimConfig(**options)


def ids(label: str, count: int) -> list[int]:
    """``count`` copies of one token id (distinct per label): a prompt of a known length."""
    return [ord(label)] * count


def spec(
    request_id: str, prompt: list[int], max_tokens: int = 1, model: str = "demo", **kw: Any
) -> RequestSpec:
    return RequestSpec.of(request_id, model, prompt, max_tokens, **kw)


async def run(engine: Engine, seq: Sequence) -> int:
    """Consume a sequence to the end; returns the number of tokens generated."""
    count = 0
    async for _ in engine.tokens(seq):
        count += 1
    return count


async def complete(engine: Engine, request: RequestSpec) -> Sequence:
    seq = engine.submit(request)
    await run(engine, seq)
    return seq


# --------------------------------------------------------------------------- KV cache


def blocks(cache: KVCache, char: str, tokens: int) -> PromptBlocks:
    """A prompt of ``tokens`` identical token ids (``ord(char)``), hashed by ``cache``."""
    return cache.prompt_blocks([ord(char)] * tokens)


def test_lookup_never_hits_the_last_prompt_token() -> None:
    cache = KVCache(num_blocks=10, block_size=4)
    prompt = blocks(cache, "b", 8)  # 8 tokens, 2 full blocks
    hashes = prompt.hashes
    allocation = cache.allocate(prompt, 8)
    assert allocation is not None and allocation.hit_tokens == 0
    cache.free(allocation)
    assert cache.lookup(hashes, 8) == 1  # the second block holds the last token: recomputed
    assert cache.lookup(hashes, 9) == 2


def test_lru_eviction_frees_the_oldest_cached_blocks() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    old_blocks, new_blocks = blocks(cache, "o", 8), blocks(cache, "n", 8)
    old, new = old_blocks.hashes, new_blocks.hashes
    for prompt in (old_blocks, new_blocks):
        allocation = cache.allocate(prompt, 8)
        assert allocation is not None
        cache.free(allocation)
    assert cache.evictable_blocks == 4 and cache.usage == 0
    third = cache.allocate(blocks(cache, "t", 4), 4)  # needs one block
    assert third is not None
    assert not cache.contains(old[1])  # the old request's tail block went first
    assert cache.contains(old[0]) and cache.contains(new[0]) and cache.contains(new[1])


def test_running_blocks_are_never_evicted() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    running_blocks = blocks(cache, "r", 8)
    running = cache.allocate(running_blocks, 8)
    finished = cache.allocate(blocks(cache, "f", 8), 8)
    assert running is not None and finished is not None
    assert cache.allocate(blocks(cache, "x", 1), 1) is None  # full: it must wait
    cache.free(finished)
    big = cache.allocate(blocks(cache, "g", 8), 8)
    assert big is not None
    assert all(cache.contains(h) for h in running_blocks.hashes)
    assert cache.pinned_blocks == 4 and cache.usage == 1.0
    assert cache.allocate(blocks(cache, "y", 1), 1) is None


# --------------------------------------------------------------------------- prefix caching in the engine


async def test_cached_prefix_gives_smaller_ttft_and_exact_token_counters() -> None:
    engine = Engine(config())
    prompt = ids("p", 10)  # 10 tokens; blocks of 4: lookups cover (10 - 1) // 4 = 2 blocks
    cold = await complete(engine, spec("cold", prompt))
    warm = await complete(engine, spec("warm", prompt))
    assert (cold.cached_tokens, cold.uncached_tokens, cold.ttft_ms) == (0, 10, 10.0 + 10)
    assert (warm.cached_tokens, warm.uncached_tokens, warm.ttft_ms) == (8, 2, 10.0 + 2)
    partial = await complete(
        engine, spec("partial", ids("p", 5) + ids("q", 5))
    )  # shares one block (5 tokens)
    assert (partial.cached_tokens, partial.ttft_ms) == (4, 10.0 + 6)
    counters = engine.snapshot().counters
    assert counters.prefix_cache_queries == 30
    assert counters.prefix_cache_hits == 8 + 4
    assert counters.prompt_tokens == 30


async def test_adapters_do_not_share_the_base_model_cache() -> None:
    engine = Engine(config(lora_modules=("ad",), lora_load_time=0.0))
    await complete(engine, spec("base", ids("s", 10)))
    other = await complete(engine, spec("lora", ids("s", 10), model="ad"))
    assert other.cached_tokens == 0


async def test_kv_usage_counts_only_running_blocks() -> None:
    engine = Engine(config(kv_cache_size=10))
    seq = engine.submit(spec("a", ids("u", 10), max_tokens=3))  # 10 tokens: 3 blocks of 4
    assert engine.snapshot().kv_cache_usage == pytest.approx(0.3)
    await run(engine, seq)
    assert engine.snapshot().kv_cache_usage == 0
    assert engine.kv.evictable_blocks == 2  # the two full prompt blocks stay cached


async def test_request_waits_for_kv_blocks_and_queue_shows_it() -> None:
    engine = Engine(config(kv_cache_size=4, max_num_seqs=5))
    big = engine.submit(spec("big", ids("b", 12)))  # 12 tokens: 3 of 4 blocks
    blocked = engine.submit(spec("blocked", ids("c", 8)))  # 8 tokens: 2 blocks, only 1 free
    behind = engine.submit(spec("behind", ids("d", 1)))  # would fit, but the queue is FIFO
    assert [s.state for s in (big, blocked, behind)] == [SeqState.RUNNING, SeqState.WAITING, SeqState.WAITING]
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (1, 2, 0.75)
    engine.abort(big)
    assert blocked.state is SeqState.RUNNING and behind.state is SeqState.RUNNING
    engine.abort(blocked)
    engine.abort(behind)


async def test_prompt_longer_than_the_cache_runs_alone_with_the_whole_cache() -> None:
    engine = Engine(config(kv_cache_size=4))
    small = engine.submit(spec("small", ids("s", 1)))
    huge = engine.submit(spec("huge", ids("h", 100)))  # 100 tokens: 25 blocks, the cache has 4
    assert huge.state is SeqState.WAITING
    engine.abort(small)
    assert huge.state is SeqState.RUNNING and engine.snapshot().kv_cache_usage == 1.0
    assert await run(engine, huge) == 1
    assert engine.snapshot().kv_cache_usage == 0


async def test_waiting_queue_grows_past_max_num_seqs() -> None:
    engine = Engine(config(max_num_seqs=2))
    seqs = [engine.submit(spec(f"r{i}", ids("w", 2))) for i in range(5)]
    snap = engine.snapshot()
    assert (snap.running, snap.waiting) == (2, 3)
    assert [s.state for s in seqs].count(SeqState.WAITING) == 3
    for seq in seqs:
        engine.abort(seq)
    assert (engine.snapshot().running, engine.snapshot().waiting) == (0, 0)


async def test_load_factor_slows_a_fuller_batch() -> None:
    engine = Engine(config(max_num_seqs=3, time_factor_under_load=1.0, prefill_time_per_token=0.0))
    seqs = [engine.submit(spec(f"r{i}", ids(str(i), 1))) for i in range(3)]
    assert [s.ttft_ms for s in seqs] == [10.0, 15.0, 20.0]  # x1, x1.5, x2
    model = engine.latency
    assert model.itl_ms(1) == 2.0 and model.itl_ms(3) == 4.0
    for seq in seqs:
        engine.abort(seq)


def test_latency_jitter_is_seeded_and_never_negative() -> None:
    def model(seed: int) -> LatencyModel:
        return LatencyModel(10.0, 0.0, 2.0, 0.0, 4, 50.0, 50.0, rng=random.Random(seed))

    first = [model(7).ttft_ms(0, 1) for _ in range(3)]
    assert first == [model(7).ttft_ms(0, 1) for _ in range(3)]
    samples = [model(seed).ttft_ms(0, 1) for seed in range(50)] + [model(1).itl_ms(1) for _ in range(50)]
    assert min(samples) >= 0 and len(set(samples)) > 2


async def test_latency_histograms_count_observations() -> None:
    engine = Engine(config())
    await complete(engine, spec("h", ids("h", 1), max_tokens=3))
    counters = engine.snapshot().counters
    assert counters.time_to_first_token.count == 1
    assert counters.inter_token_latency.count == 2
    assert counters.request_queue_time.count == 1
    assert counters.time_to_first_token.cumulative()[-1] == ("+Inf", 1.0)


async def test_remote_prefill_skips_the_prefill_cost() -> None:
    engine = Engine(config())
    seq = await complete(engine, spec("d", ids("k", 10), remote_prefill=True))
    assert (seq.uncached_tokens, seq.ttft_ms) == (0, 10.0)


# --------------------------------------------------------------------------- LoRA


def test_lora_slots_evict_only_idle_adapters() -> None:
    slots = LoraSlots(max_loras=1)
    assert slots.acquire("a", []) == FROM_DISK
    assert slots.acquire("a", ["a"]) == RESIDENT
    assert not slots.can_acquire("b", ["a"]) and slots.acquire("b", ["a"]) is None
    assert slots.acquire("b", []) == FROM_DISK
    assert slots.loaded == ("b",)


async def test_lora_requests_wait_for_a_slot_and_labels_follow() -> None:
    engine = Engine(config(lora_modules=("a", "b"), max_loras=1, lora_load_time=50.0))
    first = engine.submit(spec("1", ids("x", 1), model="a"))
    second = engine.submit(spec("2", ids("y", 1), model="b"))  # no slot: waits
    base = engine.submit(spec("3", ids("z", 1)))  # the base model passes it
    same = engine.submit(spec("4", ids("v", 1), model="a"))  # already loaded: no load time
    assert [s.state for s in (first, second, base, same)] == [
        SeqState.RUNNING,
        SeqState.WAITING,
        SeqState.RUNNING,
        SeqState.RUNNING,
    ]
    assert (first.lora_load_ms, same.lora_load_ms, base.lora_load_ms) == (50.0, 0.0, 0.0)
    assert first.ttft_ms > same.ttft_ms
    snap = engine.snapshot()
    assert (snap.running_lora_adapters, snap.waiting_lora_adapters) == (("a",), ("b",))
    engine.abort(first)
    assert second.state is SeqState.WAITING  # "a" is still in use by another request
    engine.abort(same)
    assert second.state is SeqState.RUNNING and second.lora_load_ms == 50.0
    snap = engine.snapshot()
    assert (snap.running_lora_adapters, snap.waiting_lora_adapters) == (("b",), ())
    engine.abort(second)
    engine.abort(base)


# --------------------------------------------------------------------------- HTTP


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = SimServer(
        SimConfig(
            port=0,
            time_scale=0.0,
            block_size=4,
            lora_modules=("ad1", "ad2"),
            max_loras=2,
            enable_prompt_tokens_details=True,
        )
    )
    await server.start()
    yield server
    await server.stop()


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    [found] = [v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items()]
    return found


def cached_prefix(first: list[int], second: list[int], block_size: int) -> int:
    """Tokens of ``second`` a cache holding ``first`` serves: whole shared blocks, never the last token."""
    shared = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), len(first))
    return min(shared, len(second) - 1) // block_size * block_size


async def test_chat_prefix_is_cached_across_requests(sim: SimServer, session: aiohttp.ClientSession) -> None:
    system = {"role": "system", "content": "s" * 64}
    chats = [[system, {"role": "user", "content": question}] for question in ("abcd", "efgh")]
    prompts = [TOK.chat_ids(messages) for messages in chats]  # what the simulator's tokenizer makes of them
    hit = cached_prefix(prompts[0], prompts[1], 4)
    assert hit >= 8  # the system message spans whole blocks
    totals = []
    for messages in chats:
        body = {"messages": messages, "max_tokens": 1}
        async with session.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            totals.append((await resp.json())["usage"])
    assert [u["prompt_tokens"] for u in totals] == [len(p) for p in prompts]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in totals] == [0, hit]
    samples = await scrape(session, sim.url)
    assert value(samples, "vllm:prefix_cache_queries_total") == sum(len(p) for p in prompts)
    assert value(samples, "vllm:prefix_cache_hits_total") == hit
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 2
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 0
    assert value(samples, "vllm:request_queue_time_seconds_count") == 2


@pytest.mark.parametrize(
    ("kind", "status"),
    [("rate_limit", 429), ("server_error", 500), ("invalid_request", 400), ("model_not_found", 404)],
)
async def test_force_error_header(
    sim: SimServer, session: aiohttp.ClientSession, kind: str, status: int
) -> None:
    headers = {"x-sim-force-error": kind}
    async with session.post(f"{sim.url}/v1/completions", json={"prompt": "x"}, headers=headers) as resp:
        assert resp.status == status
        assert resp.headers["x-inference-port"] == str(sim.port)
        body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == status
    samples = await scrape(session, sim.url)
    assert value(samples, "vllm:prefix_cache_queries_total") == 0  # never reached the engine


async def test_unknown_forced_error_is_a_bad_request(sim: SimServer, session: aiohttp.ClientSession) -> None:
    headers = {"x-sim-force-error": "nope"}
    async with session.post(f"{sim.url}/v1/completions", json={"prompt": "x"}, headers=headers) as resp:
        assert resp.status == 400


async def test_failure_injection_rate(session: aiohttp.ClientSession) -> None:
    options: dict[str, Any] = {"port": 0, "time_scale": 0.0}
    always = SimConfig(**options, failure_injection_rate=1.0, failure_types=("server_error",))
    never = SimConfig(**options)
    for cfg, status in ((always, 500), (never, 200)):
        async with SimServer(cfg) as server:
            for _ in range(3):
                async with session.post(f"{server.url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == status


async def test_lora_adapters_are_served(sim: SimServer, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{sim.url}/v1/models") as resp:
        data = (await resp.json())["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("demo", None), ("ad1", "demo"), ("ad2", "demo")]
    body = {"model": "ad2", "prompt": "hello", "max_tokens": 2}
    async with session.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert (await resp.json())["model"] == "ad2"
    samples = await scrape(session, sim.url)
    assert value(samples, "vllm:lora_requests_info", max_lora="2", running_lora_adapters="") > 0
    assert sim.engine.loras.loaded == ("ad2",)


async def test_prefill_request_returns_kv_transfer_params(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": None}
    body = {"prompt": "k" * 40, "max_tokens": 1, "kv_transfer_params": params}
    async with session.post(f"{sim.url}/v1/completions", json=body) as resp:
        data = await resp.json()
    returned = data["kv_transfer_params"]
    assert returned["do_remote_prefill"] is True and returned["do_remote_decode"] is False
    blocks = -(-len(TOK.prompt_ids("k" * 40)) // 4)  # the prompt's tokens in blocks of 4
    assert returned["remote_port"] == sim.port and returned["remote_block_ids"] == list(range(blocks))
    async with session.post(f"{sim.url}/v1/completions", json={"prompt": "k"}) as resp:
        assert "kv_transfer_params" not in await resp.json()


async def test_decode_role_does_not_answer_kv_transfer_params(session: aiohttp.ClientSession) -> None:
    body = {"prompt": "k" * 8, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    async with (
        SimServer(SimConfig(port=0, time_scale=0.0, role="decode")) as server,
        session.post(f"{server.url}/v1/completions", json=body) as resp,
    ):
        assert "kv_transfer_params" not in await resp.json()


@pytest.mark.parametrize(
    ("params", "remote"),
    [
        ({"do_remote_prefill": True}, True),
        ({"do_remote_prefill": False, "remote_block_ids": [1, 2]}, True),
        ({"do_remote_prefill": False, "remote_block_ids": None}, False),
        (None, False),
    ],
)
def test_remote_prefill_detection(params: dict[str, Any] | None, remote: bool) -> None:
    body = {"prompt": "abc", "kv_transfer_params": params}
    assert parse_request(body, SimConfig(), TOK, chat=False).remote_prefill is remote


async def test_data_parallel_ranks_are_independent(session: aiohttp.ClientSession) -> None:
    assert [c.port for c in rank_configs(SimConfig(port=9000, data_parallel_size=3))] == [9000, 9001, 9002]
    async with SimCluster(SimConfig(port=0, time_scale=0.0, data_parallel_size=2)) as cluster:
        first, second = cluster.servers
        assert first.port != second.port
        async with session.post(f"{first.url}/v1/completions", json={"prompt": "Grüße!"}) as resp:
            assert resp.headers["x-inference-port"] == str(first.port)
        async with session.get(f"{second.url}/health") as resp:
            assert resp.headers["x-inference-port"] == str(second.port)
        assert value(await scrape(session, first.url), "vllm:prompt_tokens_total") == len(
            TOK.prompt_ids("Grüße!")
        )
        assert value(await scrape(session, second.url), "vllm:prompt_tokens_total") == 0


def test_cli_new_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--prefill-time-per-token", "0.2", "--time-factor-under-load", "2",
            "--time-to-first-token-std-dev", "1", "--inter-token-latency-std-dev", "0.5",
            "--lora-modules", "a", "b", "--max-loras", "2", "--lora-load-time", "5",
            "--failure-injection-rate", "0.5", "--failure-types", "rate_limit", "server_error",
            "--role", "prefill", "--data-parallel-size", "2", "--seed", "3",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.prefill_time_per_token, cfg.time_factor_under_load) == (0.2, 2.0)
    assert (cfg.time_to_first_token_std_dev, cfg.inter_token_latency_std_dev) == (1.0, 0.5)
    assert (cfg.lora_modules, cfg.max_loras, cfg.lora_load_time) == (("a", "b"), 2, 5.0)
    assert (cfg.failure_injection_rate, cfg.failure_types) == (0.5, ("rate_limit", "server_error"))
    assert (cfg.role, cfg.data_parallel_size, cfg.seed) == ("prefill", 2, 3)
    for bad in (["--failure-injection-rate", "2"], ["--role", "x"], ["--failure-types", "boom"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(ValueError, match="lora_modules"):
        SimConfig(lora_modules=("demo",))
