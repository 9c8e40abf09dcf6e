"""The bulk scoring path picks exactly what the per-endpoint path picks.

Random pools (metrics with ties, stale and out-of-range values, prefix-cache states built by the
real producer: holder groups read as sparse labels), random profiles (scorers, order, weights
including 0, a filter, a Python scorer without a bulk path, pickers returning one or several
endpoints) and several requests per pool with metrics changing in between (the bulk path's reuse
across requests, and its columns patched where the metrics journal names a few changed
endpoints). The reference is the same profile with ``bulk=False`` (the per-endpoint path) fed the
plain dict the producer used to write, with the picker's random generator in the same state:
picks, recorded scores and the generator's state afterwards must be identical.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Sequence

import orjson
import pytest

from epp.framework import (
    ApiKind,
    CycleState,
    Endpoint,
    EndpointMetadata,
    Filter,
    LLMRequest,
    Metrics,
    NoParams,
    ProfileRunResult,
    RequestBody,
    SchedulingResult,
    Scorer,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixMatches, group_counts
from epp.framework.metrics_journal import MetricsJournal
from epp.framework.sparse import SparseLabels
from epp.plugins.pickers import _common
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.producers._prefix_index import PrefixIndex
from epp.plugins.producers.approx_prefix_cache import ApproxPrefixCacheParams, ApproxPrefixCacheProducer
from epp.plugins.scorers import prefix_spread
from epp.plugins.scorers.kv_cache_utilization import KVCacheUtilizationScorer
from epp.plugins.scorers.prefix_cache import PrefixCacheScorer, PrefixCacheScorerParams
from epp.plugins.scorers.prefix_spread import PrefixSpreadParams, PrefixSpreadScorer
from epp.plugins.scorers.queue import QueueScorer
from epp.plugins.scorers.running_requests_size import RunningRequestsSizeScorer
from epp.scheduling import SchedulerProfile, WeightedScorer
from epp.scheduling.decision import DECISION_KEY

MODEL = "m"
SYSTEM = "You are a careful assistant. " * 12


class _Jitter(Scorer):
    """A third-party style scorer: per endpoint, no bulk path, values outside [0, 1] too."""

    type_name = "test-jitter"

    def __init__(self, seed: int) -> None:
        super().__init__("jitter", NoParams())
        self._seed = seed

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        out = []
        for e in endpoints:
            h = hash((self._seed, e.metadata.key)) % 7
            out.append((-0.5, 0.0, 0.25, 0.25, 1.0, 1.5, 0.75)[h])
        return out


class _DropSome(Filter):
    type_name = "test-drop-some"

    def __init__(self, modulo: int) -> None:
        super().__init__("drop", NoParams())
        self._modulo = modulo

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return [e for i, e in enumerate(endpoints) if i % self._modulo] or endpoints


def _metrics(rnd: random.Random, now: float) -> Metrics:
    fresh = rnd.random()
    return Metrics(
        waiting_queue_size=rnd.choice((0, 0, 1, 2, 5, rnd.randint(0, 50))),
        running_requests_size=rnd.choice((0, 3, 3, rnd.randint(0, 64))),
        kv_cache_usage_percent=rnd.choice((0.0, 0.5, 0.5, 1.0, 1.2, -0.1, rnd.random())),
        update_time=now,
        # mostly fresh; some stale (unknown: neutral scores) in some pools
        fresh_until=math.inf if fresh < 0.8 else (now + 3600.0 if fresh < 0.9 else now - 1.0),
    )


def _request(text: str, i: int) -> LLMRequest:
    payload = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
    }
    raw = orjson.dumps(payload)
    return LLMRequest(f"r{i}", RequestBody(ApiKind.CHAT_COMPLETIONS, payload, raw), {}, MODEL, MODEL)


def _profile(
    rnd: random.Random, seed: int, bulk: bool, scorers: list[tuple[Scorer, float]], k: int, drop: int
) -> SchedulerProfile:
    return SchedulerProfile(
        "p",
        filters=[_DropSome(drop)] if drop else [],
        scorers=[WeightedScorer(s, w) for s, w in scorers],
        picker=MaxScorePicker("picker", PickerParams(k)),
        record_scores=True,
        decide=True,
        bulk=bulk,
    )


class _Clock:
    """A clock that stands still while both paths score one request (the spread scorer's
    new-prompt decay reads it), then moves on."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def _spread(rnd: random.Random) -> PrefixSpreadScorer:
    params = PrefixSpreadParams(
        load_bound=rnd.choice((0.0, 1.0, 1.25, 2.0)),
        load_bound_min=rnd.choice((1, 2, 8)),
        balance_weight=rnd.choice((0.0, 0.25, 1.0)),
        new_prompt_weight=rnd.choice((0.0, 2.0, 5.0)),
        hash_prefix_chars=rnd.choice((0, 16, 512)),
    )
    return PrefixSpreadScorer("spread", params)


async def _one_seed(seed: int) -> int:
    clock = _Clock(time.monotonic())
    saved = prefix_spread.time
    prefix_spread.time = clock  # type: ignore[assignment]
    try:
        return await _seed(seed, clock)
    finally:
        prefix_spread.time = saved


async def _seed(seed: int, clock: _Clock) -> int:
    rnd = random.Random(seed)
    now = time.monotonic()
    n = rnd.choice((1, 2, 3, 10, 40, 130))
    endpoints = [
        Endpoint(EndpointMetadata(f"e{i}", f"10.0.{i // 250}.{i % 250}", 8000), _metrics(rnd, now))
        for i in range(n)
    ]
    all_known = rnd.random() < 0.5
    if all_known:  # every endpoint known: the bulk path's reuse applies
        for e in endpoints:
            e.metrics = dataclasses.replace(e.metrics, fresh_until=math.inf)
    producer = ApproxPrefixCacheProducer("approx", ApproxPrefixCacheParams(block_size_tokens=4))
    texts = [f"topic {t} " * rnd.randint(1, 30) for t in range(6)]
    for i in range(rnd.randint(0, 3 * n)):  # prefix index: random prompts on random endpoints
        req = _request(rnd.choice(texts)[: rnd.randint(0, 200)], i)
        cycle = CycleState()
        await producer.produce(cycle, req, endpoints)
        producer.pre_request(
            cycle, req, SchedulingResult({"p": ProfileRunResult([rnd.choice(endpoints)])}, "p")
        )
    weights = (0.0, 0.5, 1.0, 2.0, 3.0, rnd.uniform(-1.0, 4.0))
    pool: list[Scorer] = [
        QueueScorer("queue", NoParams()),
        KVCacheUtilizationScorer("kv", NoParams()),
        PrefixCacheScorer("prefix", PrefixCacheScorerParams(match_length_weight=rnd.choice((0.0, 0.0, 0.5)))),
        RunningRequestsSizeScorer("running", NoParams()),
        _Jitter(seed),
        _spread(rnd),
    ]
    rnd.shuffle(pool)
    chosen = [(s, rnd.choice(weights)) for s in pool[: rnd.randint(0, len(pool))]]
    k = rnd.choice((1, 1, 1, 3))
    drop = rnd.choice((0, 0, 0, 3))
    bulk = _profile(rnd, seed, True, chosen, k, drop)
    per_endpoint = _profile(rnd, seed, False, chosen, k, drop)
    checked = 0
    for r in range(6):
        if r and rnd.random() < 0.6:  # some scrapes land between requests (few: the kept columns are patched)
            for e in rnd.sample(endpoints, k=min(n, rnd.choice((1, 1, 2, 3, rnd.randint(1, n))))):
                if rnd.random() < 0.3:
                    e.metrics = dataclasses.replace(e.metrics)
                    continue
                m = _metrics(rnd, now)
                if all_known and rnd.random() < 0.9:
                    m = dataclasses.replace(m, fresh_until=math.inf)
                e.metrics = m
        req = _request(rnd.choice(texts)[: rnd.randint(0, 200)], 1000 + r)
        cycle = CycleState()
        candidates = list(endpoints)
        await producer.produce(cycle, req, candidates)
        infos = cycle[PREFIX_CACHE_MATCH_INFO_KEY]
        assert isinstance(infos, PrefixMatches)
        plain = CycleState(cycle)
        # what the producer wrote before (read without walking the mapping, which would fill it)
        plain[PREFIX_CACHE_MATCH_INFO_KEY] = {e: infos[e] for e in candidates}
        assert len(plain[PREFIX_CACHE_MATCH_INFO_KEY]) == len(set(candidates))

        clock.now += rnd.choice((0.0, 0.5, 30.0))
        spread = [s for s, _ in chosen if isinstance(s, PrefixSpreadScorer)]
        state = random.Random(seed * 7919 + r).getstate()
        _common.rng.setstate(state)
        bulk_cycle = CycleState(cycle)
        got = bulk.run(bulk_cycle, req, candidates)
        after_bulk = _common.rng.getstate()
        _common.rng.setstate(state)
        want = per_endpoint.run(plain, req, candidates)
        assert [e.metadata.key for e in got.target_endpoints] == [
            e.metadata.key for e in want.target_endpoints
        ], f"seed {seed} request {r}"
        assert got.target_endpoints == want.target_endpoints
        assert got.scores == want.scores, f"seed {seed} request {r}"
        assert after_bulk == _common.rng.getstate(), f"seed {seed} request {r}: random draws differ"
        # the explained decision (each scorer's weighted score of the pick and runners-up) is the same
        (got_decision,) = bulk_cycle[DECISION_KEY]
        (want_decision,) = plain[DECISION_KEY]
        assert got_decision.decision() == want_decision.decision(), (
            f"seed {seed} request {r}: {got_decision.decision()} != {want_decision.decision()}"
        )
        producer.pre_request(cycle, req, SchedulingResult({"p": got}, "p"))
        for s in spread:  # the spread scorer's counts and new prompts follow the pick
            s.pre_request(bulk_cycle, req, SchedulingResult({"p": got}, "p"))
            if rnd.random() < 0.5:
                s.request_done(req, SchedulingResult({"p": got}, "p"))
        checked += 1
    return checked


def test_bulk_path_picks_what_the_per_endpoint_path_picks() -> None:
    async def run() -> int:
        return sum([await _one_seed(seed) for seed in range(400)])

    assert asyncio.run(run()) == 400 * 6


def test_holder_groups_give_the_counts_of_match() -> None:
    """``match_groups`` (what the producer reads) names each endpoint at the count ``match`` gives,
    and the sparse labels built from them read as the dense ones."""
    rnd = random.Random(3)
    index = PrefixIndex()
    keys = [f"ns/e{i}" for i in range(40)]
    chains = [[rnd.randrange(1 << 64) for _ in range(30)] for _ in range(5)]
    for _ in range(300):
        chain = rnd.choice(chains)
        index.add(chain[: rnd.randint(1, 30)], rnd.choice(keys), rnd.choice((8, 40, 1000)))
    endpoints = [Endpoint(EndpointMetadata(f"e{i}", "10.0.0.1", 8000 + i)) for i in range(45)]
    ordered = [e.metadata.key for e in endpoints]
    for chain in chains:
        for length in (1, 5, 30):
            hashes = chain[:length]
            groups = index.match_groups(hashes)
            assert group_counts(groups) == index.match(hashes)
            m = PrefixMatches(
                endpoints,
                frozenset(endpoints),
                ordered,
                None,
                length,
                16,
                groups,
                {k: i for i, k in enumerate(ordered)},
                frozenset(ordered),
            )
            sparse = m.labels(endpoints)
            assert isinstance(sparse, SparseLabels)
            assert list(sparse) == [index.match(hashes).get(k) for k in ordered]


def test_metrics_journal_names_the_changed_endpoints() -> None:
    journal = MetricsJournal(size=4)
    a, b = object(), object()
    seq = journal.seq
    journal.note(a)
    journal.note(b)
    journal.note(a)
    assert journal.since(seq) == (seq + 3, [a, b, a])
    assert journal.since(seq + 3) == (seq + 3, [])
    for _ in range(4):
        journal.note(b)
    assert journal.since(seq + 2)[1] is None  # the log no longer reaches back: read everything


def test_prefix_matches_reads_as_the_plain_dict() -> None:
    endpoints = [Endpoint(EndpointMetadata(f"e{i}", "10.0.0.1", 8000 + i)) for i in range(5)]
    outsider = Endpoint(EndpointMetadata("x", "10.0.0.2", 8000))
    m = PrefixMatches(
        endpoints,
        frozenset(endpoints),
        [e.metadata.key for e in endpoints],
        {"default/e1": 3, "default/x": 2},
        4,
        16,
    )
    assert m.get(outsider) is None and outsider not in m and len(m) == 5 and m
    assert m[endpoints[1]].match_blocks == 3 and m.get(endpoints[0]).match_blocks == 0
    with pytest.raises(KeyError):
        m[outsider]
    labels = m.labels(endpoints)
    assert labels is not None and list(labels) == [None, 3, None, None, None]
    assert m.info(3) is m[endpoints[1]] and m.info(None).match_blocks == 0
    assert m.labels(endpoints[1:]) is None  # another candidate list: no bulk answer
    plain = dict(m.items())
    assert list(plain) == endpoints and [i.match_blocks for i in plain.values()] == [0, 3, 0, 0, 0]
    assert m == plain and isinstance(m, dict)


def test_kept_columns_expire_with_the_metrics_freshness() -> None:
    """Scores kept while every candidate is fresh are not reused once one goes stale."""
    now = time.monotonic()
    endpoints = [
        Endpoint(
            EndpointMetadata(f"e{i}", "10.0.0.1", 8000 + i), Metrics(waiting_queue_size=q, fresh_until=f)
        )
        for i, (q, f) in enumerate([(0, math.inf), (9, now + 0.05), (5, math.inf), (3, math.inf)])
    ]
    scorers = [WeightedScorer(QueueScorer("queue", NoParams()), 1.0)]

    def profile(bulk: bool) -> SchedulerProfile:
        return SchedulerProfile("p", scorers=scorers, picker=MaxScorePicker("m", PickerParams(4)), bulk=bulk)

    bulk, per_endpoint = profile(True), profile(False)
    req = _request("hello", 0)
    order = [e.metadata.name for e in bulk.run(CycleState(), req, list(endpoints)).target_endpoints]
    assert order == ["e0", "e3", "e2", "e1"]  # all known: shortest queue first
    time.sleep(max(0.0, now + 0.06 - time.monotonic()))  # e1's metrics go stale: scored neutrally
    _common.rng.seed(5)
    got = bulk.run(CycleState(), req, list(endpoints))
    _common.rng.seed(5)
    want = per_endpoint.run(CycleState(), req, list(endpoints))
    assert got.target_endpoints == want.target_endpoints
    names = [e.metadata.name for e in got.target_endpoints]
    assert names[0] == "e0" and names.index("e1") < 3  # no longer last


def test_weight_zero_bulk_scorers_are_not_called() -> None:
    calls: list[str] = []

    class _Counted(QueueScorer):
        def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
            calls.append(self.name)
            return super().score(cycle, request, endpoints)

    endpoints = [
        Endpoint(EndpointMetadata(f"e{i}", "10.0.0.1", 8000 + i), Metrics(fresh_until=math.inf))
        for i in range(3)
    ]
    p = SchedulerProfile(
        "p",
        scorers=[
            WeightedScorer(_Counted("zero", NoParams()), 0.0),
            WeightedScorer(_Counted("one", NoParams()), 1.0),
        ],
        picker=MaxScorePicker("m", PickerParams()),
    )
    p.run(CycleState(), _request("x", 0), list(endpoints))
    p.run(CycleState(), _request("y", 1), list(endpoints))  # same candidates and metrics: kept
    assert calls == ["one"]
