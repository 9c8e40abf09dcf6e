"""``precise-prefix-cache-producer``: configuration, and events in → PrefixCacheMatchInfo out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from epp.framework import CycleState, ProfileRunResult, SchedulingResult
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo, TokenizedPrompt
from epp.framework.endpoint import SCRAPE_CONNECT_FAILURE, Metrics
from epp.framework.interfaces import EndpointEvent, EventType
from epp.framework.params import decode_params
from epp.plugins.producers.precise_prefix_cache import PrecisePrefixCacheParams, PrecisePrefixCacheProducer
from tests.unit import factories as f
from tests.unit.kv_publisher import Publisher, batch, free_port, stored
from tests.unit.polling import until

PLUGIN = "- name: pp\n  type: precise-prefix-cache-producer\n  parameters:\n"
PROFILE = (
    "- type: prefix-cache-scorer\n  parameters:\n    prefixMatchInfoProducerName: pp\n"
    "schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: prefix-cache-scorer\n"
)


def _cfg(params: str) -> str:
    return "plugins:\n" + PLUGIN + "".join(f"    {line}\n" for line in params.splitlines()) + PROFILE


def test_reference_defaults() -> None:
    p = decode_params(PrecisePrefixCacheParams, {}, "parameters")
    assert p.token_processor_config.effective_block_size == 16
    mem = p.indexer_config.kv_block_index_config.in_memory_config
    assert (mem.size, mem.pod_cache_size) == (100_000_000, 10)
    assert [(b.name, b.weight) for b in p.indexer_config.kv_cache_backend_configs] == [
        ("gpu", 1.0),
        ("cpu", 0.8),
    ]
    ev = p.kv_events_config
    assert (ev.topic_filter, ev.concurrency, ev.engine_type, ev.discover_pods) == ("kv@", 4, "vllm", True)
    assert (ev.pod_discovery_config.socket_port, ev.pod_discovery_config.replay_socket_port) == (5557, 0)
    assert (p.speculative_indexing, p.speculative_ttl_seconds) == (False, 2.0)
    deprecated = decode_params(PrecisePrefixCacheParams, {"tokenProcessorConfig": {"blockSize": 64}}, "p")
    assert deprecated.token_processor_config.effective_block_size == 64
    ns = {"indexerConfig": {"kvBlockIndexConfig": {"metricsLoggingInterval": 60_000_000_000}}}
    assert (
        decode_params(PrecisePrefixCacheParams, ns, "p").indexer_config.kv_block_index_config.logging_interval
        == 60
    )


def test_loads_in_a_configuration() -> None:
    cfg = f.config(_cfg("tokenProcessorConfig:\n  blockSizeTokens: 5\nspeculativeIndexing: true"))
    plugin = cfg.plugins["pp"]
    assert isinstance(plugin, PrecisePrefixCacheProducer)
    assert plugin.block_size == 5
    assert not plugin.ingester.running  # check-config and load start nothing


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        (
            "indexerConfig:\n  kvBlockIndexConfig:\n    redisConfig:\n      address: r:6379",
            "indexerConfig.kvBlockIndexConfig.redisConfig",
            "in memory only",
        ),
        (
            "indexerConfig:\n  kvBlockIndexConfig:\n    costAwareMemoryConfig: {}",
            "indexerConfig.kvBlockIndexConfig.costAwareMemoryConfig",
            "in memory only",
        ),
        (
            "indexerConfig:\n  tokenizersPoolConfig: {}",
            "indexerConfig.tokenizersPoolConfig",
            "token-producer",
        ),
        ("kvEventsConfig:\n  engineType: trt", "kvEventsConfig.engineType", "unsupported engine type"),
        ("tokenProcessorConfig:\n  hashAlgorithm: sha1", "tokenProcessorConfig.hashAlgorithm", "cbor-fnv"),
        (
            "tokenProcessorConfig:\n  blockSizeTokens: -1",
            "tokenProcessorConfig.blockSizeTokens",
            "greater than 0",
        ),
        ("speculativeTTL: soon", "speculativeTTL", "invalid duration"),
        (
            "indexerConfig:\n  kvBlockIndexConfig:\n    inMemoryConfig:\n      size: 0",
            "indexerConfig.kvBlockIndexConfig.inMemoryConfig.size",
            "greater than 0",
        ),
        (
            "kvEventsConfig:\n  podDiscoveryConfig:\n    socketPort: 70000",
            "kvEventsConfig.podDiscoveryConfig.socketPort",
            "between 1 and 65535",
        ),
        ("kvEventsConfig:\n  concurrency: 0", "kvEventsConfig.concurrency", "greater than 0"),
        ("kvEventsConfig:\n  topicFiltr: kv", "kvEventsConfig.topicFiltr", "unknown parameter"),
    ],
)
def test_validation_errors_name_the_field(params: str, field: str, reason: str) -> None:
    err = f.config_error(_cfg(params))
    assert err.field.endswith(f"parameters.{field}"), err.field
    assert reason in err.reason


# --- end to end in process ---------------------------------------------------------------------

TOKENS = list(range(1, 33))  # 8 blocks of 4


def _request(tokens: list[int] | None, *, exact: bool = True, model: str = "m") -> f.LLMRequest:  # type: ignore[name-defined]
    r = f.completions("text", model=model)
    if tokens is not None:
        r.body.tokenized = TokenizedPrompt(tokens, exact=exact)
    return r


@pytest.fixture
async def producer() -> AsyncIterator[tuple[PrecisePrefixCacheProducer, int]]:
    port = free_port()
    params = decode_params(
        PrecisePrefixCacheParams,
        {
            "tokenProcessorConfig": {"blockSizeTokens": 4},
            "kvEventsConfig": {"podDiscoveryConfig": {"socketPort": port}},
            "speculativeIndexing": True,
            "speculativeTTL": "300ms",
        },
        "parameters",
    )
    p = PrecisePrefixCacheProducer("pp", params)
    await p.start_serving()
    try:
        yield p, port
    finally:
        await p.stop_serving()


async def _produce(p: PrecisePrefixCacheProducer, req: object, eps: list) -> CycleState:  # type: ignore[type-arg]
    cycle = CycleState()
    await p.produce(cycle, req, eps)  # type: ignore[arg-type]
    return cycle


async def test_events_in_match_info_out(producer: tuple[PrecisePrefixCacheProducer, int]) -> None:
    p, port = producer
    e0 = f.endpoint("e0", "127.0.0.1", 8000)
    e1 = f.endpoint("e1", "127.0.0.2", 8000)
    pub = Publisher(port)
    try:
        p.extract_metadata(e0)  # the store added it: subscribed
        p.extract_metadata(e1)
        await asyncio.to_thread(pub.wait_subscribed)
        pub.send(batch([stored(list(range(100, 106)), TOKENS[:24], bs=4)]))  # 6 of the 8 blocks
        await until(lambda: bool(p.index.match(p.keyer.keys(TOKENS), [e0.metadata.key])))
        cycle = await _produce(p, _request(TOKENS), [e0, e1])
        infos = cycle[PREFIX_CACHE_MATCH_INFO_KEY]
        assert infos[e0] == PrefixCacheMatchInfo(6, 8, 4)
        assert infos[e1] == PrefixCacheMatchInfo(0, 8, 4)
        # no tokenized prompt, or estimated ids: no output
        assert PREFIX_CACHE_MATCH_INFO_KEY not in await _produce(p, _request(None), [e0, e1])
        assert PREFIX_CACHE_MATCH_INFO_KEY not in await _produce(p, _request(TOKENS, exact=False), [e0, e1])
        # the endpoint leaves: unsubscribed, its entries gone
        p.extract_endpoint(EndpointEvent(EventType.DELETE, e0))
        await until(lambda: e0.metadata.key not in p.ingester.streams)
        infos = (await _produce(p, _request(TOKENS), [e0, e1]))[PREFIX_CACHE_MATCH_INFO_KEY]
        assert infos[e0].match_blocks == 0
    finally:
        pub.close()


async def test_lora_blocks_match_requests_for_the_adapter(
    producer: tuple[PrecisePrefixCacheProducer, int],
) -> None:
    p, port = producer
    e0 = f.endpoint("e0", "127.0.0.1", 8000)
    pub = Publisher(port)
    try:
        p.extract_metadata(e0)
        await asyncio.to_thread(pub.wait_subscribed)
        pub.send(batch([stored([1, 2], TOKENS[:8], bs=4, lora="sql-lora")]))
        await until(lambda: "sql-lora" in p.applier.loras)
        await until(lambda: len(p.index) == 2)
        lora = (await _produce(p, _request(TOKENS, model="sql-lora"), [e0]))[PREFIX_CACHE_MATCH_INFO_KEY]
        base = (await _produce(p, _request(TOKENS, model="base"), [e0]))[PREFIX_CACHE_MATCH_INFO_KEY]
        assert (lora[e0].match_blocks, base[e0].match_blocks) == (2, 0)
    finally:
        pub.close()


async def test_speculative_entries_for_decode_and_prefill_expire(
    producer: tuple[PrecisePrefixCacheProducer, int],
) -> None:
    p, _ = producer
    d, pf = f.endpoint("d", "127.0.0.9", 8000), f.endpoint("pf", "127.0.0.8", 8000)
    cycle = await _produce(p, _request(TOKENS), [d, pf])
    assert cycle[PREFIX_CACHE_MATCH_INFO_KEY][d].match_blocks == 0
    result = SchedulingResult(
        {"decode": ProfileRunResult([d]), "prefill": ProfileRunResult([pf])}, primary_profile_name="decode"
    )
    p.pre_request(cycle, _request(TOKENS), result)
    infos = (await _produce(p, _request(TOKENS), [d, pf]))[PREFIX_CACHE_MATCH_INFO_KEY]
    assert (infos[d].match_blocks, infos[pf].match_blocks) == (8, 8)
    await until(lambda: len(p.index) == 0, timeout=10)  # expired by the ingestion thread
    infos = (await _produce(p, _request(TOKENS), [d, pf]))[PREFIX_CACHE_MATCH_INFO_KEY]
    assert infos[d].match_blocks == 0


async def test_a_down_engine_s_blocks_attract_nothing_and_are_checked_on_its_return(
    producer: tuple[PrecisePrefixCacheProducer, int],
) -> None:
    p, port = producer
    e0 = f.endpoint("e0", "127.0.0.1", 8000)
    pub = Publisher(port)
    try:
        p.extract_metadata(e0)
        await asyncio.to_thread(pub.wait_subscribed)
        pub.send(batch([stored(list(range(100, 106)), TOKENS[:24], bs=4)]))
        await until(lambda: bool(p.index.match(p.keyer.keys(TOKENS), [e0.metadata.key])))
        e0.metrics = Metrics(failure=SCRAPE_CONNECT_FAILURE)  # the scraper found no server
        infos = (await _produce(p, _request(TOKENS), [e0]))[PREFIX_CACHE_MATCH_INFO_KEY]
        assert infos[e0].match_blocks == 0
        e0.metrics = Metrics()  # back: maybe another engine; without replay its old blocks go
        await _produce(p, _request(TOKENS), [e0])
        await until(lambda: not p.index.match(p.keyer.keys(TOKENS), [e0.metadata.key]))
        infos = (await _produce(p, _request(TOKENS), [e0]))[PREFIX_CACHE_MATCH_INFO_KEY]
        assert infos[e0].match_blocks == 0
    finally:
        pub.close()


async def test_an_engine_block_size_other_than_block_size_tokens_is_named_once(
    producer: tuple[PrecisePrefixCacheProducer, int],
) -> None:
    p, _ = producer
    e0 = f.endpoint("e0", "127.0.0.1", 8000, metrics=Metrics(cache_block_size=128))  # vLLM CPU's default
    e1 = f.endpoint("e1", "127.0.0.2", 8000, metrics=Metrics(cache_block_size=4))  # as configured
    with capture_logs() as logs:
        for _ in range(3):
            await _produce(p, _request(TOKENS), [e0, e1])
    told = [e for e in logs if "block size differs" in e["event"]]
    assert [(e["endpoint"], e["engine_block_size"], e["block_size_tokens"]) for e in told] == [
        (e0.metadata.key, 128, 4)
    ]
