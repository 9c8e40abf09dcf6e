"""Shared routing state beyond the prefix index and in-flight load: the session-affinity map, the
no-hit LRU, flow control's in-flight shares and the utilization detector's credit, each a
``CrossReplicaContributor`` (supply / install / valid), and all four through a real ``redis-server``."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import orjson
import redis

from epp.datalayer.cross_replica import CrossReplicaRuntime
from epp.dev.stack.redis_server import RedisServer
from epp.flowcontrol import BandSettings, FlowController, FlowControlSettings
from epp.flowcontrol.controller import SHARED_STATE_KEY
from epp.framework import CycleState, Endpoint, Metrics, ProfileRunResult, SchedulingResult
from epp.framework.cross_replica import (
    MAX_CLOCK_SKEW_SECONDS,
    CrossReplicaContributor,
    SharedLog,
    SharedValue,
    fold_sum,
    valid_count,
    valid_time,
)
from epp.framework.params import decode_params
from epp.plugins.filters.session_affinity_filter import SessionAffinityFilter
from epp.plugins.flow_control.round_robin import RoundRobinFairnessPolicy
from epp.plugins.saturation.utilization_detector import UtilizationDetector, UtilizationDetectorParams
from epp.plugins.scorers._session import MAX_SHARED_SESSION_ID, SessionStore
from epp.plugins.scorers.no_hit_lru import NoHitLRUParams, NoHitLRUScorer
from epp.plugins.scorers.session_affinity import SessionAffinityScorer
from epp.plugins.syncers import _metrics
from epp.plugins.syncers.redis_syncer import RedisSyncer, RedisSyncerParams
from tests.redis_fixture import redis_server as redis_server
from tests.unit.factories import StubHandle, config, endpoint, request
from tests.unit.test_flow_controller import FIFO, Slots
from tests.unit.test_flow_controller import request as fc_request

POOL = "ns/pool"


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _eps(n: int = 3) -> list[Endpoint]:
    return [endpoint(f"p{i}", f"10.0.0.{i}", namespace="ns") for i in range(n)]


def _result(target: Endpoint) -> SchedulingResult:
    return SchedulingResult({"decode": ProfileRunResult([target])}, "decode")


def _spec(contributor: Any) -> Any:
    assert isinstance(contributor, CrossReplicaContributor)
    (spec,) = contributor.cross_replica_specs()
    return spec


def test_folds_and_checks_of_the_contract() -> None:
    assert fold_sum([{"a": 1, "b": 2}, {"a": 3}]) == {"a": 4, "b": 2}
    assert [valid_count(v) for v in (0, 7, 1 << 53, -1, True, 1.0, "1", None)] == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        False,
    ]
    now = time.time()
    good = [now, int(now), now + MAX_CLOCK_SKEW_SECONDS - 60]
    bad = [0, -1.0, math.nan, math.inf, True, "1", None, now + MAX_CLOCK_SKEW_SECONDS + 60]
    assert all(valid_time(v) for v in good) and not any(valid_time(v) for v in bad)


# --- session affinity -------------------------------------------------------------------------


def _store(wall: float, ttl: float = 300.0) -> tuple[SessionStore, _Clock, _Clock]:
    mono, clock = _Clock(1000.0), _Clock(wall)
    store = SessionStore(ttl, 10.0, mono, clock)
    store.start_recording()
    return store, mono, clock


def test_session_store_records_nothing_without_a_syncer() -> None:
    store = SessionStore(300.0, 10.0)
    store.commit("s", "ns/p0", bound_absent=False)
    assert store.take_records() == [] and store.get("s") == "ns/p0"


def test_a_session_pinned_by_one_replica_is_honoured_by_another() -> None:
    pool = _eps()
    a, b = SessionAffinityScorer("sa", _params()), SessionAffinityFilter("sa", _params())
    log_a, log_b = _spec(a), _spec(b)
    assert isinstance(log_a, SharedLog) and log_a.state_key == "session-affinity-scorer/sa"
    assert log_b.state_key == "session-affinity-filter/sa"
    req = request(headers={"x-session-id": "conv-1"})
    assert a.score(CycleState(), req, pool) == [0.0, 0.0, 0.0]
    a.pre_request(CycleState(), req, _result(pool[2]))  # A binds conv-1 to p2
    records = log_a.take()
    assert len(records) == 1 and records[0][:2] == ["conv-1", "ns/p2"]
    assert all(log_b.valid(r) for r in records)
    assert b.filter(CycleState(), req, pool) == pool  # B knows nothing yet
    log_b.apply(records)
    assert b.filter(CycleState(), req, pool) == [pool[2]]  # now B pins it too
    assert log_a.take() == []  # drained
    # the stateless strategy shares nothing: the client carries the endpoint
    assert SessionAffinityScorer("st", _params("encoded_endpoint_header")).cross_replica_specs() == []


def _params(strategy: str = "session_id") -> Any:
    return decode_params(SessionAffinityScorer.Params, {"strategy": strategy}, "parameters")


def test_conflicting_bindings_converge_on_the_newest_stamp_on_every_replica() -> None:
    a, _, wall_a = _store(5000.0)
    b, _, wall_b = _store(5000.0)
    a.commit("s", "ns/p0", bound_absent=False)
    wall_b.t = 5000.5  # B bound the same new session elsewhere half a second later
    b.commit("s", "ns/p1", bound_absent=False)
    ra, rb = a.take_records(), b.take_records()
    a.apply_records(rb)
    b.apply_records(ra)
    assert a.get("s") == b.get("s") == "ns/p1"
    # a move (the bound endpoint was no candidate) stamps later than what it replaces, even with
    # a clock behind the binding's stamp
    wall_a.t = 5000.2
    a.commit("s", "ns/p2", bound_absent=True)
    (move,) = a.take_records()
    assert move[1] == "ns/p2" and move[2] > 5000.5
    b.apply_records([move])
    assert b.get("s") == "ns/p2"
    # an older record of a binding it replaced changes nothing
    b.apply_records(ra)
    assert b.get("s") == "ns/p2"


def test_a_session_in_use_is_announced_again_so_peers_keep_it_alive() -> None:
    a, mono_a, wall_a = _store(5000.0, ttl=100.0)
    b, mono_b, wall_b = _store(5000.0, ttl=100.0)
    a.commit("s", "ns/p0", bound_absent=False)
    b.apply_records(a.take_records())
    for _ in range(5):  # in use at A every 5 s: a refresh after 10 s (a tenth of the TTL)
        for clock in (mono_a, wall_a, mono_b, wall_b):
            clock.t += 5.0
        a.commit("s", "ns/p0", bound_absent=False)
        b.apply_records(a.take_records())
    assert a.take_records() == []
    for clock in (mono_a, wall_a, mono_b, wall_b):
        clock.t += 80.0  # 105 s after the binding, 80 s after the last announced use
    b.commit("other", "ns/p1", bound_absent=False)  # runs B's sweep
    assert b.get("s") == "ns/p0"
    for clock in (mono_b, wall_b):
        clock.t += 25.0  # past the TTL since the last announced use
    b.commit("other", "ns/p1", bound_absent=False)
    assert b.get("s") is None


def test_records_of_expired_sessions_and_malformed_records_are_not_applied() -> None:
    a, _, _ = _store(5000.0, ttl=60.0)
    late, _, wall = _store(5000.0, ttl=60.0)
    a.commit("old", "ns/p0", bound_absent=False)
    records = a.take_records()
    wall.t = 5061.0  # a replica that starts a minute later reads the kept records
    late.apply_records(records)
    assert late.get("old") is None
    log = _spec(SessionAffinityScorer("sa", _params()))
    now = time.time()
    bad = [
        ["s", "ns/p0", now],  # short
        ["", "ns/p0", now, now],
        ["x" * (MAX_SHARED_SESSION_ID + 1), "ns/p0", now, now],
        ["s", 7, now, now],
        ["s", "", now, now],
        ["s", "ns/p0", now + 2 * MAX_CLOCK_SKEW_SECONDS, now],
        ["s", "ns/p0", now, "yesterday"],
        {"s": "ns/p0"},
    ]
    assert not any(log.valid(r) for r in bad)
    assert log.valid(["s", "ns/p0", now, now])
    # a session id too long to share stays local
    a.commit("y" * (MAX_SHARED_SESSION_ID + 1), "ns/p1", bound_absent=False)
    assert a.take_records() == []


# --- no-hit LRU -------------------------------------------------------------------------------


def _cold(scorer: NoHitLRUScorer, pool: list[Endpoint], picked: Endpoint) -> list[float]:
    cycle = CycleState()
    scores = scorer.score(cycle, request(), pool)
    scorer.pre_request(cycle, request(), _result(picked))
    return scores


def test_the_no_hit_lru_follows_the_fleets_cold_picks() -> None:
    pool = _eps()
    alone = NoHitLRUScorer("lru", NoHitLRUParams())
    _cold(alone, pool, pool[0])
    assert alone._lru == {"ns/p0": None}  # no syncer: no clock read, nothing kept for peers

    a, b = NoHitLRUScorer("lru", NoHitLRUParams()), NoHitLRUScorer("lru", NoHitLRUParams())
    va, vb = _spec(a), _spec(b)
    assert isinstance(va, SharedValue) and va.state_key == "no-hit-lru-scorer/lru"
    _cold(b, pool, pool[0])
    _cold(b, pool, pool[1])  # B: p0 then p1; p2 never
    _cold(a, pool, pool[0])  # A later sends a cold request to p0
    supplied = va.supply()
    assert list(supplied) == ["ns/p0"] and valid_time(supplied["ns/p0"])
    before = _cold_scores(b, pool)
    assert before[2] > before[0] > before[1]  # p2 never used, then p0 least recently
    vb.install(supplied)
    after = _cold_scores(b, pool)
    assert after[2] > after[1] > after[0]  # A's pick made p0 the most recent at B
    assert b.lru_keys() == ["ns/p1", "ns/p0"]
    vb.install({"ns/p1": supplied["ns/p0"] - 100.0})  # an older peer pick reorders nothing
    assert b.lru_keys() == ["ns/p1", "ns/p0"]
    assert set(vb.supply()) == {"ns/p0", "ns/p1"}  # only B's own picks, never the peers' times


def _cold_scores(scorer: NoHitLRUScorer, pool: list[Endpoint]) -> list[float]:
    return scorer.score(CycleState(), request(), pool)


def test_the_shared_no_hit_lru_keeps_its_capacity() -> None:
    pool = _eps(3)
    s = NoHitLRUScorer("lru", decode_params(NoHitLRUParams, {"lruSize": 2}, "parameters"))
    spec = _spec(s)
    for e in pool:
        _cold(s, pool, e)
    assert s.lru_keys() == ["ns/p1", "ns/p2"]
    now = time.time()
    spec.install({"ns/p0": now + 1.0, "ns/p9": now + 2.0})
    assert s.lru_keys() == ["ns/p0", "ns/p9"]  # the two most recent of the fleet
    assert set(spec.supply()) == {"ns/p0"}  # our own picks still in the LRU (with our time)


# --- utilization detector credit --------------------------------------------------------------


def _scraped(e: Endpoint, *, at: float, inflight_at_scrape: int = 0) -> None:
    e.metrics = Metrics(update_time=at, fresh_until=at + 10.0, inflight_at_scrape=inflight_at_scrape)


def test_the_detector_counts_what_other_replicas_sent_since_its_scrape() -> None:
    pool = _eps(2)
    params = decode_params(
        UtilizationDetectorParams, {"queueDepthThreshold": 2, "metricsStalenessThreshold": "10s"}, "p"
    )
    d = UtilizationDetector("ud", params, StubHandle(endpoints=pool))
    now = time.monotonic()
    for e in pool:
        _scraped(e, at=now)
    assert d.dispatch_saturation(pool, 0) == 0.0
    spec = _spec(d)
    assert spec.state_key == "utilization-detector/ud" and spec.supply() == {}
    pool[0].inflight = 3
    assert spec.supply() == {"ns/p0": 3}
    pool[0].inflight = 0
    spec.install({"ns/p0": 2})  # peers sent 2 to p0 (no scrape of ours since we know of)
    assert d.dispatch_saturation(pool, 0) == (2 / 2 + 0) / 2
    spec.install({"ns/p0": 2})  # the same: unchanged
    assert d.dispatch_saturation(pool, 0) == 0.5
    _scraped(pool[0], at=now + 1.0)  # our scrape now shows those 2 (e.g. running)
    spec.install({"ns/p0": 3})  # and a peer sent one more since
    assert d.dispatch_saturation(pool, 0) == (1 / 2) / 2
    spec.install({"ns/p0": 1})  # two of theirs finished: room freed since our scrape
    assert d.dispatch_saturation(pool, 0) == 0.0
    # never scraped: everything in flight, ours and theirs, is queued
    fresh = endpoint("p5", "10.0.0.5", namespace="ns")
    d2 = UtilizationDetector("ud", params, StubHandle(endpoints=[fresh]))
    fresh.inflight = 1
    _spec(d2).install({"ns/p5": 3})
    assert d2.dispatch_saturation([fresh], 0) == 4 / 2
    assert not any(spec.valid(v) for v in (-1, 1.5, "2", None, True)) and spec.valid(4)


def test_without_a_syncer_the_detector_is_unchanged() -> None:
    pool = _eps(2)
    params = decode_params(UtilizationDetectorParams, {"queueDepthThreshold": 2}, "p")
    d = UtilizationDetector("ud", params, StubHandle(endpoints=pool))
    now = time.monotonic()
    for e in pool:
        _scraped(e, at=now)
    pool[1].inflight = 2
    assert d.dispatch_saturation(pool, 0) == 0.5 and d._peers == {}


# --- flow control's in-flight shares ----------------------------------------------------------


def _controller(pool: list[Endpoint], slots: Slots) -> FlowController:
    rr = RoundRobinFairnessPolicy("rr", None)
    band = BandSettings(max_requests=0, max_bytes=0, fairness=rr, ordering=FIFO)
    settings = FlowControlSettings(default_band=band)
    return FlowController(settings, slots, lambda: pool, pool_name="pool", tick=0.002)


async def test_flow_control_shares_in_flight_by_band_and_flow() -> None:
    pool = _eps(2)
    slots = Slots(capacity=4)
    fc = _controller(pool, slots)
    spec = _spec(fc)
    assert spec.state_key == SHARED_STATE_KEY and spec.supply() == {}
    held = []
    for name, flow, prio in (("a1", "heavy", 0), ("a2", "heavy", 0), ("b1", "light", 0), ("c1", "x", 5)):
        permit = await fc.admit(fc_request(name, flow=flow, priority=prio), 0.0)
        permit.release()
        held.append(permit)
    assert spec.supply() == {"0": {"heavy": 2, "light": 1}, "5": {"x": 1}}
    assert all(spec.valid(v) for v in spec.supply().values())
    held.pop().done()
    assert spec.supply() == {"0": {"heavy": 2, "light": 1}}
    bad = [{"f": -1}, {"f": 1.5}, {"f": True}, ["f", 1], {"f" * 2000: 1}, "x"]
    assert not any(spec.valid(v) for v in bad)
    # the peers' in-flight requests count in the band's shares
    spec.install({"0": {"light": 3, "other": 2}, "not-a-band": {"z": 1}, "7": {"late": 1}})
    band = fc._bands[0]
    assert band.inflight_of("light") == 4 and band.inflight_of("heavy") == 2
    assert band.inflight_total == 3 + 5 and band.local_total == 3
    assert band.active_flows() == 3  # heavy and light in flight here, other at a peer
    late = fc._band(7)  # a band made after the install gets the peers' counts too
    assert late.inflight_of("late") == 1
    spec.install({})
    assert band.inflight_of("light") == 1 and band.inflight_total == 3 and band.active_flows() == 2
    fc.close()


async def test_a_flow_over_its_fleet_share_waits_for_one_under_it() -> None:
    """Locally the heavy flow (1 in flight against the light flow's 2) is under its share and goes
    first; counting the other replicas' 6 heavy requests it is over it, so the light flow does."""
    for shared, first in ((False, "heavy-9"), (True, "light-1")):
        pool = _eps(2)
        slots = Slots(capacity=4)
        fc = _controller(pool, slots)
        spec = _spec(fc)
        held = []
        for name, flow in (("light-0", "light"), ("light-x", "light"), ("l", "light"), ("heavy-0", "heavy")):
            permit = await fc.admit(fc_request(name, flow=flow), 0.0)
            permit.release()
            slots.inflight += 1
            held.append(permit)
        if shared:
            spec.install({"0": {"heavy": 6}})
        order: list[str] = []

        tasks = [asyncio.ensure_future(_admitted(fc, "heavy-9", "heavy", order))]
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(_admitted(fc, "light-1", "light", order)))
        await asyncio.sleep(0)
        held.pop(0).done()  # a light request ends: one slot frees
        slots.inflight -= 1
        await asyncio.sleep(0.02)
        assert order[:1] == [first], (shared, order)
        fc.close()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _admitted(fc: FlowController, name: str, flow: str, order: list[str]) -> None:
    permit = await fc.admit(fc_request(name, flow=flow), 0.0)
    order.append(name)
    permit.release()


# --- all four through a real redis-server -----------------------------------------------------


def _syncer(server: RedisServer) -> RedisSyncer:
    return RedisSyncer("sync", decode_params(RedisSyncerParams, {"address": server.address}, "p"))


async def test_the_four_states_cross_a_real_redis_and_malformed_entries_are_counted(
    redis_server: RedisServer,
) -> None:
    pool = _eps(2)
    replicas = []
    for _ in range(2):
        handle = StubHandle(endpoints=pool)
        session = SessionAffinityScorer("sa", _params())
        lru = NoHitLRUScorer("lru", NoHitLRUParams())
        detector = UtilizationDetector("ud", UtilizationDetectorParams(), handle)
        fc = _controller(pool, Slots(capacity=100))
        specs = [s for c in (session, lru, detector, fc) for s in c.cross_replica_specs()]
        runtime = CrossReplicaRuntime(_syncer(redis_server), specs, pool=POOL, interval=0.05)
        replicas.append((session, lru, detector, fc, runtime))
    (sa, la, _, fa, ra), (sb, lb, db, fb, rb) = replicas
    req = request(headers={"x-session-id": "conv"})
    sa.pre_request(CycleState(), req, _result(pool[1]))
    _cold(la, pool, pool[0])
    pool[1].inflight = 2  # A's requests on p1 (the endpoint objects are A's here)
    permit = await fa.admit(fc_request("r", flow="tenant"), 0.0)
    permit.release()
    for _ in range(2):
        await ra.step()
        await rb.step()
    pool[1].inflight = 0  # from here on the objects are B's: nothing of its own in flight
    assert sb.score(CycleState(), req, pool) == [0.0, 1.0]
    assert lb.lru_keys() == ["ns/p0"]
    assert db._peers == {"ns/p1": (2, 2)}
    assert fb._bands.get(0) is None and fb._peer_inflight == {0: {"tenant": 1}}

    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    prefix = f"llm-d-epp:{POOL}:"
    vkey = f"{prefix}v:{ra.syncer.replica_id}"
    raw.hset(
        vkey,
        mapping={
            "no-hit-lru-scorer/lru|ns/p1": orjson.dumps("soon"),
            "utilization-detector/ud|ns/p0": orjson.dumps(-4),
            f"{SHARED_STATE_KEY}|0": orjson.dumps({"tenant": "many"}),
        },
    )
    raw.xadd(
        f"{prefix}log:session-affinity-scorer/sa",
        {"r": "peer", "t": str(time.time()), "d": orjson.dumps([["conv", "ns/p0", "x", 1], ["s2"]])},
    )
    invalid = _metrics.SKIPPED.labels("invalid").value
    await rb.step()
    assert _metrics.SKIPPED.labels("invalid").value == invalid + 5
    assert sb.score(CycleState(), req, pool) == [0.0, 1.0]  # the bad record moved nothing
    assert lb.lru_keys() == ["ns/p0"]
    assert fb._peer_inflight == {}  # A's value was replaced by a malformed one: not trusted
    assert db._peers == {"ns/p1": (2, 2)}
    raw.close()
    permit.done()
    for *_, runtime in replicas:
        await runtime.stop()
    for _, _, _, fc, _ in replicas:
        fc.close()


# --- what epp serve registers -----------------------------------------------------------------

_SERVE_CONFIG = """
featureGates: [flowControl]
plugins:
- {name: shared, type: redis-syncer, parameters: {address: "127.0.0.1:6379"}}
- {name: sa, type: session-affinity-scorer, parameters: {strategy: session_id}}
- {name: lru, type: no-hit-lru-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: sa}, {pluginRef: lru}, {pluginRef: max-score-picker}]
"""


def _server(body: str) -> Any:
    from epp.server.app import EppServer, ServeOptions

    cfg = config(body)
    return cfg, EppServer(cfg, ServeOptions())


def test_epp_serve_shares_plugins_the_default_detector_and_flow_control() -> None:
    cfg, server = _server(
        _SERVE_CONFIG + "dataLayer: {crossReplicaSyncerPluginRef: shared, crossReplicaSyncInterval: 50ms}\n"
    )
    runtime = server._cross_replica()
    assert runtime is not None
    keys = {s.state_key for s in (*runtime.values, *runtime.logs)}
    assert keys == {
        "session-affinity-scorer/sa",
        "no-hit-lru-scorer/lru",
        "utilization-detector/utilization-detector",  # created by the loader, not declared
        SHARED_STATE_KEY,  # the flow controller: runtime, not a plugin
        "approx-prefix-cache-producer/approx-prefix-cache-producer",  # the LRU's match producer
        "endpoint-metrics",  # the data layer: replicas share the metrics scrape
    }, (keys, sorted(cfg.plugins))


def test_without_a_syncer_nothing_records_or_registers() -> None:
    cfg, server = _server(_SERVE_CONFIG)
    assert server._cross_replica() is None
    assert cfg.plugins["sa"].affinity.store._outbox is None
    assert cfg.plugins["lru"]._mine is None


def test_every_pool_shares_its_own_state_under_its_own_name() -> None:
    """Several pools: each pool's syncer runtime has that pool's own syncer instance and contributors,
    and its keys live under the pool's name (two replicas' pools a never meet pools b)."""
    from epp.server.app import EppServer, ServeOptions

    body = (
        _SERVE_CONFIG + "dataLayer: {crossReplicaSyncerPluginRef: shared, crossReplicaSyncInterval: 50ms}\n"
    )

    def load(store: Any, text: str | None = None) -> Any:
        return config(body)

    def prefix(runtime: Any) -> str:  # the pool's redis keys' prefix
        return str(runtime.syncer._prefix)

    server = EppServer(config(body), ServeOptions(pool_name="a", pool_namespace="ns"), pool_config=load)
    other = server.pools.get_or_add("b")
    first, second = server._cross_replica(), server._cross_replica(other)
    assert first is not None and second is not None
    assert first.syncer is not second.syncer
    assert prefix(first).endswith(":ns/a:") and prefix(second).endswith(":ns/b:")
    keys = {s.state_key for s in second.values} | {s.state_key for s in second.logs}
    assert "session-affinity-scorer/sa" in keys and SHARED_STATE_KEY in keys
    all_namespaces = server.pools.get_or_add("team/c")
    third = server._cross_replica(all_namespaces)
    assert third is not None and prefix(third).endswith(":team/c:")
