"""``burst-prefix-cache-producer``: joint placement of the requests of one window."""

from __future__ import annotations

import asyncio

import pytest

from epp.datalayer.store import EndpointStore
from epp.framework import ConfigError, CycleState, Endpoint
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.params import decode_params
from epp.plugins.producers.burst_prefix_cache import BurstPrefixCacheParams, BurstPrefixCacheProducer
from epp.server.director import DirectorHooks
from tests.unit import factories

BLOCK = 4  # tokens per block: 16 characters


def _producer(**raw: object) -> BurstPrefixCacheProducer:
    params = decode_params(
        BurstPrefixCacheParams, {"blockSizeTokens": BLOCK, "windowDurationMs": 20, **raw}, "p"
    )
    return BurstPrefixCacheProducer("burst", params)


def _prompt(tag: str, blocks: int = 4) -> str:
    return (tag * 16 * blocks)[: 16 * blocks]


async def _window(
    prod: BurstPrefixCacheProducer, prompts: list[str], eps: list[Endpoint]
) -> list[str | None]:
    """Run one window of requests; the endpoint each one got a full match on (None: no affinity)."""
    requests = [factories.completions(p, request_id=str(i)) for i, p in enumerate(prompts)]
    cycles = [CycleState() for _ in requests]
    await asyncio.gather(*(prod.produce(c, r, list(eps)) for c, r in zip(cycles, requests, strict=True)))
    out: list[str | None] = []
    for c in cycles:
        infos: dict[Endpoint, PrefixCacheMatchInfo] = c[PREFIX_CACHE_MATCH_INFO_KEY]
        full = [
            e.metadata.name for e, i in infos.items() if i.total_blocks and i.match_blocks == i.total_blocks
        ]
        assert len(full) <= 1
        out.append(full[0] if full else None)
    return out


async def test_identical_prompts_of_a_window_go_to_one_replica_and_groups_spread() -> None:
    eps = factories.endpoints(3)
    got = await _window(_producer(), [_prompt("a")] * 4 + [_prompt("b")] * 3 + [_prompt("c")], eps)
    assert len(set(got[:4])) == 1 and len(set(got[4:7])) == 1
    assert got[0] != got[4] and None not in got[:7]
    assert got[7] is None  # a prompt shared with nobody keeps no affinity


async def test_max_per_replica_spills_a_group() -> None:
    eps = factories.endpoints(3)
    got = await _window(_producer(maxPerReplica=2), [_prompt("a")] * 5, eps)
    assert sorted(got.count(n) for n in {g for g in got if g}) == [1, 2, 2]


async def test_min_colocate_blocks_joins_prefix_sharing_singletons_within_the_fair_share() -> None:
    base = _prompt("s", 3)
    prompts = [_prompt("a")] * 2 + [base + _prompt("x", 1), base + _prompt("y", 1)]
    off = await _window(_producer(), prompts, factories.endpoints(2))
    assert off[2] is None and off[3] is None
    on = await _window(_producer(minColocateBlocks=3), prompts, factories.endpoints(2))
    assert on[2] is not None and on[2] == on[3] != on[0]
    # with 4 replicas the fair share is 1 request each: the second singleton may not join the first
    spread = await _window(_producer(minColocateBlocks=3), prompts, factories.endpoints(4))
    assert len({spread[0], spread[2], spread[3]}) == 3


async def test_balance_by_tokens_weighs_long_prompts() -> None:
    eps = factories.endpoints(2)
    prompts = [_prompt("L", 8)] * 2 + [_prompt("s", 1)] * 2 + [_prompt("t", 1)] * 2
    by_requests = await _window(_producer(), prompts, eps)
    by_tokens = await _window(_producer(balanceBy="tokens"), prompts, eps)
    # by request count the third group joins the long one; by prefix blocks the two short ones pair up
    assert by_requests[4] == by_requests[0] != by_requests[2]
    assert by_tokens[4] == by_tokens[2] != by_tokens[0]


async def test_requests_wait_for_the_window_and_a_full_batch_is_refused() -> None:
    prod = _producer(windowDurationMs=50, maxBatchSize=2)
    eps = factories.endpoints(2)
    reqs = [factories.completions(_prompt("a"), request_id=str(i)) for i in range(3)]
    first = asyncio.ensure_future(prod.produce(CycleState(), reqs[0], eps))
    second = asyncio.ensure_future(prod.produce(CycleState(), reqs[1], eps))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="maxBatchSize 2"):
        await prod.produce(CycleState(), reqs[2], eps)
    await asyncio.gather(first, second)
    assert prod.last_wait > 0.02


async def test_director_budget_covers_the_window() -> None:
    store = EndpointStore()
    for i in range(2):
        store.upsert(factories.metadata(f"e{i}", f"10.0.0.{i}"))
    prod = _producer(windowDurationMs=600)  # longer than the default 400 ms producers budget
    assert prod.produce_timeout == pytest.approx(0.9)
    director = factories.director(store)
    director.hooks = DirectorHooks(producers=[prod])
    body = b'{"model":"m","prompt":"' + _prompt("a").encode() + b'"}'
    routed = await asyncio.gather(
        *(director.route({":path": "/v1/completions", "x-request-id": str(i)}, body, {}) for i in range(2))
    )
    infos = [r.cycle[PREFIX_CACHE_MATCH_INFO_KEY] for r in routed if r.cycle is not None]
    assert len(infos) == 2 and all(any(i.match_blocks for i in m.values()) for m in infos)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"windowDurationMs": 0}, "windowDurationMs"),
        ({"windowDurationMs": 10001}, "windowDurationMs"),
        ({"maxPerReplica": 0}, "maxPerReplica"),
        ({"blockSizeTokens": 0}, "blockSizeTokens"),
        ({"maxPrefixTokensToMatch": 10, "blockSizeTokens": 64}, "maxPrefixTokensToMatch"),
        ({"minColocateBlocks": -1}, "minColocateBlocks"),
        ({"maxBatchSize": 0}, "maxBatchSize"),
        ({"balanceBy": "bytes"}, "balanceBy"),
    ],
)
def test_parameter_errors(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        decode_params(BurstPrefixCacheParams, raw, "p")
    assert e.value.field == f"p.{field}"


def test_defaults() -> None:
    p = decode_params(BurstPrefixCacheParams, {}, "p")
    assert (p.window_duration_ms, p.max_per_replica, p.block_size_tokens, p.max_prefix_tokens_to_match) == (
        100,
        -1,
        64,
        0,
    )
    assert (p.min_colocate_blocks, p.max_batch_size, p.balance_by) == (0, 1000, "requests")
