"""``redis-syncer`` and the cross-replica runtime against a real, private ``redis-server``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from redis.exceptions import RedisError

from epp.datalayer.cross_replica import CrossReplicaRuntime
from epp.dev.stack.redis_server import RedisServer
from epp.framework import CycleState, ProfileRunResult, SchedulingResult
from epp.framework.attributes import INFLIGHT_LOAD_KEY, PREFIX_CACHE_MATCH_INFO_KEY
from epp.framework.cross_replica import (
    CrossReplicaSyncer,
    SharedLog,
    SharedValue,
    fold_max,
    fold_sum,
    fold_union,
)
from epp.framework.errors import ConfigError
from epp.framework.params import decode_params
from epp.plugins.producers.approx_prefix_cache import ApproxPrefixCacheParams, ApproxPrefixCacheProducer
from epp.plugins.producers.inflight_load import InFlightLoadProducer
from epp.plugins.syncers import _metrics
from epp.plugins.syncers.redis_syncer import RedisSyncer, RedisSyncerParams
from tests.redis_fixture import redis_server as redis_server
from tests.redis_fixture import require_redis_server
from tests.unit.factories import completions, endpoints
from tests.unit.polling import until

POOL = "ns/pool"
KEY = "test/state"


def syncer(server: RedisServer, **params: Any) -> RedisSyncer:
    p = decode_params(RedisSyncerParams, {"address": server.address, **params}, "parameters")
    s = RedisSyncer("sync", p)
    s.bind(POOL, 0.5)
    return s


async def rounds(*syncers: RedisSyncer, n: int = 2) -> None:
    """``n`` rounds of every syncer (a new peer's values are read from the round after it is seen)."""
    for _ in range(n):
        for s in syncers:
            await s.sync()


def skipped(reason: str) -> float:
    return _metrics.SKIPPED.labels(reason).value


def test_params_are_checked() -> None:
    with pytest.raises(ConfigError, match="address"):
        decode_params(RedisSyncerParams, {"address": "nohost"}, "parameters")
    with pytest.raises(ConfigError, match="stateTTL"):
        decode_params(RedisSyncerParams, {"stateTTL": "soon"}, "parameters")
    with pytest.raises(ConfigError, match="stateTTL: must not exceed"):
        decode_params(RedisSyncerParams, {"stateTTL": "5m", "coordinationTTL": "1m"}, "parameters")
    with pytest.raises(ConfigError, match="passwordFile"):
        decode_params(RedisSyncerParams, {"passwordFile": "/nonexistent/pw"}, "parameters")
    p = decode_params(RedisSyncerParams, {}, "parameters")
    assert (p.state_ttl_seconds, p.coordination_ttl_seconds, p.address) == (2.0, 180.0, "localhost:6379")


def test_folds() -> None:
    assert fold_sum([[1, 10], [2, 5]]) == [3, 15]
    assert fold_sum([1, 2, 3]) == 6
    assert fold_max([3, 9, 1]) == 9
    assert fold_union([["a", "b"], ["b", "c"]]) == ["a", "b", "c"]
    assert fold_sum([]) is None


async def test_values_fold_over_replicas_and_peers_are_seen(redis_server: RedisServer) -> None:
    a, b, c = syncer(redis_server), syncer(redis_server), syncer(redis_server)
    assert isinstance(a, CrossReplicaSyncer)
    a.set(KEY, "ns/e1", [1, 10])
    b.set(KEY, "ns/e1", [2, 5])
    c.set(KEY, "ns/e2", [4, 4])
    await rounds(a, b, c)
    assert a.get(KEY, "ns/e1", fold_sum) == [3, 15]
    assert a.get(KEY, "ns/e1", fold_sum, include_self=False) == [2, 5]
    assert a.get(KEY, "ns/e2", fold_sum) == [4, 4]
    assert a.peers() == {b.replica_id, c.replica_id}
    # a delete reaches the others at the next round
    b.delete(KEY, "ns/e1")
    await rounds(b, a, n=1)
    assert a.get(KEY, "ns/e1", fold_sum) == [1, 10]
    # another pool's replicas share nothing with this one
    other = syncer(redis_server)
    other.bind("ns/other", 0.5)
    await rounds(other)
    assert other.peers() == frozenset() and other.get(KEY, "ns/e1", fold_sum) is None
    for s in (a, b, c, other):
        await s.close()


async def test_a_dead_replica_stops_counting_within_state_ttl(redis_server: RedisServer) -> None:
    a, b = syncer(redis_server, stateTTL="300ms"), syncer(redis_server, stateTTL="300ms")
    b.set(KEY, "ns/e1", [5, 50])
    await rounds(a, b)
    assert a.get(KEY, "ns/e1", fold_sum) == [5, 50]
    died = time.monotonic()
    await b.close()  # b stops publishing: it died

    async def gone() -> bool:
        await a.sync()
        return a.get(KEY, "ns/e1", fold_sum) is None and not a.peers()

    while not await gone():
        assert time.monotonic() - died < 3.0, "a dead replica's value outlived stateTTL"
    assert time.monotonic() - died < 0.3 + 0.5  # stateTTL plus scheduling slack
    await a.close()


async def test_malformed_and_foreign_values_are_skipped_and_counted(redis_server: RedisServer) -> None:
    a, b = syncer(redis_server), syncer(redis_server)
    b.set(KEY, "ns/e1", [1, 1])
    await rounds(a, b)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    prefix = f"llm-d-epp:{POOL}:"
    vkey = f"{prefix}v:{b.replica_id}"
    raw.hset(vkey, mapping={f"{KEY}|ns/e2": b"{not json", "no-separator": b"1", f"{KEY}|ns/e3": b"[7, 7]"})
    raw.set(f"{prefix}v:intruder", b"a string, not a hash")
    raw.zadd(f"{prefix}replicas", {"intruder": int(time.time() * 1000)})
    raw.xadd(f"{prefix}log:{KEY}", {"r": "intruder", "t": "x", "d": b"[]"})
    raw.xadd(f"{prefix}log:{KEY}", {"r": "intruder", "t": "1", "d": b"[[1, 2]]"})
    undecodable, wrong_type = skipped("undecodable"), skipped("wrong_type")
    a.subscribe(KEY)
    await a.sync()
    await a.sync()
    assert a.get(KEY, "ns/e1", fold_sum) == [1, 1]  # the good values still count
    assert a.get(KEY, "ns/e3", fold_sum) == [7, 7]
    assert a.get(KEY, "ns/e2", fold_sum) is None
    assert skipped("undecodable") >= undecodable + 3  # bad JSON, no separator, bad log time
    assert skipped("wrong_type") >= wrong_type + 1
    assert a.take_records(KEY) == [[1, 2]]  # only the well-formed batch
    assert "intruder" not in a.peers()

    # the runtime drops what a contributor's ``valid`` rejects, and counts it
    installed: list[dict[str, Any]] = []
    spec = SharedValue(KEY, dict, fold_sum, lambda f: installed.append(dict(f)), lambda v: v == [7, 7])
    runtime = CrossReplicaRuntime(a, [spec], pool=POOL, interval=0.05)
    invalid = skipped("invalid")
    assert await runtime.step()
    assert installed[-1] == {"ns/e3": [7, 7]}
    assert skipped("invalid") >= invalid + 1
    raw.close()
    await a.close()
    await b.close()


class _Counter:
    """A contributor with one local count per endpoint (the shape of in-flight counters)."""

    def __init__(self) -> None:
        self.local: dict[str, list[int]] = {}
        self.peers: dict[str, Any] = {}

    def spec(self) -> SharedValue:
        return SharedValue(
            KEY, lambda: dict(self.local), fold_sum, self._install, lambda v: isinstance(v, list)
        )

    def _install(self, folded: Any) -> None:
        self.peers = dict(folded)


async def test_redis_killed_paused_and_restarted_routing_goes_on_then_converges(
    redis_server: RedisServer,
) -> None:
    ca, cb = _Counter(), _Counter()
    sa, sb = syncer(redis_server, stateTTL="1s"), syncer(redis_server, stateTTL="1s")
    ra = CrossReplicaRuntime(sa, [ca.spec()], pool=POOL, interval=0.05, publish_timeout=0.3)
    rb = CrossReplicaRuntime(sb, [cb.spec()], pool=POOL, interval=0.05, publish_timeout=0.3)
    ca.local["ns/e1"] = [2, 20]
    cb.local["ns/e1"] = [3, 30]
    for _ in range(2):
        assert await ra.step() and await rb.step()
    assert ca.peers == {"ns/e1": [3, 30]} and cb.peers == {"ns/e1": [2, 20]}

    failures = sum(_metrics.FAILURES.labels(r).value for r in ("timeout", "connection", "error"))
    redis_server.pause()  # a frozen store: each round gives up after publishTimeout
    began = time.monotonic()
    assert not await ra.step()
    assert time.monotonic() - began < 1.0
    redis_server.kill()  # then dead: every key is lost
    for _ in range(3):
        assert not await ra.step()  # no exception reaches the caller
        assert not await rb.step()
    assert sum(_metrics.FAILURES.labels(r).value for r in ("timeout", "connection", "error")) >= failures + 6
    assert _metrics.CONNECTED.labels().value == 0
    assert ca.local == {"ns/e1": [2, 20]}  # local state untouched

    redis_server.start()  # back, empty
    ca.local["ns/e2"] = [1, 1]

    async def converged() -> bool:
        await ra.step()
        await rb.step()
        return ca.peers == {"ns/e1": [3, 30]} and cb.peers == {"ns/e1": [2, 20], "ns/e2": [1, 1]}

    await until_async(converged, 5.0)
    await ra.stop()
    await rb.stop()


async def until_async(condition: Any, timeout: float) -> None:
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout, "no convergence"


async def test_log_records_reach_the_other_replicas_and_a_new_one_reads_the_kept_ones(
    redis_server: RedisServer,
) -> None:
    a, b = syncer(redis_server), syncer(redis_server)
    for s in (a, b):
        s.subscribe(KEY)
    a.append(KEY, [[1, 2, 3]])
    a.append(KEY, [[4]])
    await rounds(a, b, n=1)
    assert b.take_records(KEY) == [[1, 2, 3], [4]]
    assert a.take_records(KEY) == []  # its own records do not come back
    assert b.take_records(KEY) == []  # each record is handed over once
    late = syncer(redis_server)
    late.subscribe(KEY)
    await late.sync()
    assert late.take_records(KEY) == [[1, 2, 3], [4]]  # a replica that starts warms up
    for s in (a, b, late):
        await s.close()


def _result(target: Any) -> SchedulingResult:
    return SchedulingResult({"decode": ProfileRunResult([target])}, "decode")


async def test_replicas_share_in_flight_load_and_the_approximate_prefix_index(
    redis_server: RedisServer,
) -> None:
    eps = endpoints(3)
    params = decode_params(ApproxPrefixCacheParams, {"autoTune": False, "blockSizeTokens": 4}, "parameters")
    replicas = []
    for _ in range(2):
        prefix = ApproxPrefixCacheProducer("approx", params)
        inflight = InFlightLoadProducer("inflight")
        runtime = CrossReplicaRuntime(
            syncer(redis_server),
            [*prefix.cross_replica_specs(), *inflight.cross_replica_specs()],
            pool=POOL,
            interval=0.05,
        )
        replicas.append((prefix, inflight, runtime))
    (pa, ia, ra), (pb, ib, rb) = replicas
    req = completions("a shared system prompt that spans several blocks " * 4, request_id="r1")
    cycle = CycleState()
    await pa.produce(cycle, req, eps)
    await ia.produce(cycle, req, eps)
    pa.pre_request(cycle, req, _result(eps[2]))  # replica A routes the prompt to e2
    ia.pre_request(cycle, req, _result(eps[2]))
    for _ in range(2):
        await ra.step()
        await rb.step()
    seen = CycleState()
    await pb.produce(seen, req, eps)
    await ib.produce(seen, req, eps)
    info = seen[PREFIX_CACHE_MATCH_INFO_KEY]
    assert info[eps[2]].match_blocks == info[eps[2]].total_blocks > 0  # B knows where A sent it
    assert info[eps[0]].match_blocks == 0
    load = seen[INFLIGHT_LOAD_KEY]
    assert load[eps[2]].requests == 1 and load[eps[2]].tokens > 0  # A's request counts at B
    assert load[eps[0]].requests == 0
    ia.request_done(req, _result(eps[2]))
    await ra.step()
    await rb.step()
    after = CycleState()
    await ib.produce(after, req, eps)
    assert after[INFLIGHT_LOAD_KEY][eps[2]].requests == 0  # released at A, released at B
    for _, _, r in replicas:
        await r.stop()


async def test_a_malformed_prefix_record_is_not_applied(redis_server: RedisServer) -> None:
    params = decode_params(ApproxPrefixCacheParams, {"autoTune": False}, "parameters")
    prefix = ApproxPrefixCacheProducer("approx", params)
    (spec,) = prefix.cross_replica_specs()
    assert isinstance(spec, SharedLog)
    s = syncer(redis_server)
    runtime = CrossReplicaRuntime(s, [spec], pool=POOL, interval=0.05)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    bad = [[["x"], "ns/e1", 10], [[1, 2], "", 10], [[-1], "ns/e1", 10], "junk", [[5, 6], "ns/e1", 10]]
    raw.xadd(
        f"llm-d-epp:{POOL}:log:{spec.state_key}", {"r": "peer", "t": str(time.time()), "d": orjson.dumps(bad)}
    )
    invalid = skipped("invalid")
    await runtime.step()
    assert skipped("invalid") == invalid + 4
    assert prefix.index.holders(5) == {"ns/e1"} and prefix.index.size() == 2
    raw.close()
    await runtime.stop()


async def test_polling_lag_is_within_the_sync_interval(redis_server: RedisServer) -> None:
    """The measured figure behind the choice of polling: a record is applied within one interval
    plus a round trip (bounded loosely here; the benchmark reports the histogram)."""
    got: list[Any] = []
    queue: list[Any] = []

    def take() -> list[Any]:
        out = queue[:]
        queue.clear()
        return out

    a, b = syncer(redis_server), syncer(redis_server)
    ra = CrossReplicaRuntime(a, [SharedLog(KEY, list, got.extend, lambda r: True)], pool=POOL, interval=0.05)
    rb = CrossReplicaRuntime(b, [SharedLog(KEY, take, list, lambda r: True)], pool=POOL, interval=0.05)
    ra.start()
    rb.start()
    await until(lambda: ra.rounds > 1 and rb.rounds > 1, 5.0)
    queue.append(["x"])
    sent = time.monotonic()
    await until(lambda: bool(got), 5.0, interval=0.002)
    assert got == [["x"]]
    assert time.monotonic() - sent < 1.0
    await ra.stop()
    await rb.stop()


async def test_an_unchanged_peer_hash_is_not_read_again_and_a_change_is_seen_the_next_round(
    redis_server: RedisServer,
) -> None:
    a, b = syncer(redis_server), syncer(redis_server)
    b.set(KEY, "ns/e1", [1, 10])
    b.set(KEY, "ns/e2", [2, 20])
    await rounds(a, b)
    assert a.get(KEY, "ns/e1", fold_sum) == [1, 10] and a.get(KEY, "ns/e2", fold_sum) == [2, 20]
    decoded, view = a.decoded, a.peer_values(KEY)
    await rounds(a, b, n=5)  # b's heartbeat moves every round, its values do not
    assert a.decoded == decoded  # nothing decoded again
    assert a.peer_values(KEY) is view  # the same mapping: the runtime need not fold it again
    assert a.peers() == {b.replica_id}
    b.set(KEY, "ns/e1", [7, 70])
    await rounds(b, a, n=1)
    assert a.get(KEY, "ns/e1", fold_sum) == [7, 70] and a.get(KEY, "ns/e2", fold_sum) == [2, 20]
    assert a.decoded == decoded + 1  # only the field whose bytes changed
    assert a.peer_values(KEY) is not view
    # a write under b's name by someone else changes the hash's digest: it is read too
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    raw.hset(f"llm-d-epp:{POOL}:v:{b.replica_id}", f"{KEY}|ns/e3", b"[3, 30]")
    await a.sync()
    assert a.get(KEY, "ns/e3", fold_sum) == [3, 30]
    raw.close()
    await a.close()
    await b.close()


async def test_a_restarted_store_converges_to_the_same_values_and_then_to_new_ones(
    redis_server: RedisServer,
) -> None:
    a, b = syncer(redis_server, stateTTL="1s"), syncer(redis_server, stateTTL="1s")
    for s in (a, b):
        s.subscribe(KEY)
    b.set(KEY, "ns/e1", [4, 40])
    await rounds(a, b)
    assert a.get(KEY, "ns/e1", fold_sum) == [4, 40]
    redis_server.kill()  # every key and the loaded script are lost
    redis_server.start()

    async def synced(s: RedisSyncer) -> bool:
        try:
            await s.sync()
        except Exception:
            return False
        return True

    async def converged() -> bool:  # both rounds went through, then a sees what b published
        ok = await synced(b) and await synced(a)
        return ok and a.get(KEY, "ns/e1", fold_sum) == [4, 40] and a.peers() == {b.replica_id}

    await until_async(converged, 5.0)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    assert raw.hget(f"llm-d-epp:{POOL}:v:{b.replica_id}", f"{KEY}|ns/e1") == b"[4,40]"  # republished
    raw.close()
    b.set(KEY, "ns/e1", [5, 50])
    b.append(KEY, [["after"]])
    await rounds(b, a, n=1)
    assert a.get(KEY, "ns/e1", fold_sum) == [5, 50]
    assert a.take_records(KEY) == [["after"]]
    await a.close()
    await b.close()


async def test_a_lost_hash_is_republished_whole(redis_server: RedisServer) -> None:
    a, b = syncer(redis_server), syncer(redis_server)
    b.set(KEY, "ns/e1", [1, 1])
    b.set(KEY, "ns/e2", [2, 2])
    await rounds(a, b)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    raw.delete(f"llm-d-epp:{POOL}:v:{b.replica_id}")  # e.g. evicted
    await rounds(b, b, a, n=1)  # b notices, then rewrites everything
    assert a.get(KEY, "ns/e1", fold_sum) == [1, 1] and a.get(KEY, "ns/e2", fold_sum) == [2, 2]
    raw.close()
    await a.close()
    await b.close()


async def test_a_hash_larger_than_one_command_chunk_is_written_and_read_whole(
    redis_server: RedisServer,
) -> None:
    a, b = syncer(redis_server), syncer(redis_server)
    for i in range(1500):
        b.set(KEY, f"ns/e{i}", [i, 1])
    await rounds(a, b)
    assert len(a.peer_values(KEY)) == 1500
    assert a.get(KEY, "ns/e1499", fold_sum) == [1499, 1]
    for i in range(0, 1500, 2):
        b.delete(KEY, f"ns/e{i}")
    await rounds(b, a, n=1)
    assert len(a.peer_values(KEY)) == 750 and a.get(KEY, "ns/e0", fold_sum) is None
    await a.close()
    await b.close()


async def test_the_runtime_folds_again_only_when_the_peers_values_changed(redis_server: RedisServer) -> None:
    folds: list[int] = []
    installed: list[dict[str, Any]] = []

    def counting_sum(values: Any) -> Any:
        folds.append(len(values))
        return fold_sum(values)

    local: dict[str, Any] = {}
    a, b = syncer(redis_server), syncer(redis_server)
    ra = CrossReplicaRuntime(
        a,
        [SharedValue(KEY, dict, counting_sum, lambda f: installed.append(dict(f)), lambda v: True)],
        pool=POOL,
        interval=0.05,
    )
    rb = CrossReplicaRuntime(
        b,
        [SharedValue(KEY, lambda: dict(local), fold_sum, lambda f: None, lambda v: True)],
        pool=POOL,
        interval=0.05,
    )
    local["ns/e1"] = [1, 1]
    for _ in range(2):
        assert await rb.step() and await ra.step()
    assert installed[-1] == {"ns/e1": [1, 1]}
    folded, calls = len(folds), len(installed)
    for _ in range(3):
        assert await rb.step() and await ra.step()
    assert len(folds) == folded  # nothing changed: the last fold is installed again
    assert len(installed) == calls + 3 and installed[-1] == {"ns/e1": [1, 1]}  # install runs every round
    local["ns/e1"] = [2, 2]
    assert await rb.step() and await ra.step()
    assert len(folds) == folded + 1 and installed[-1] == {"ns/e1": [2, 2]}
    await ra.stop()
    await rb.stop()


async def test_a_password_protected_store_and_a_wrong_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_redis_server()
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        (tmp_path / "pw").write_text("s3cret\n")
        monkeypatch.setenv("EPP_TEST_REDIS_PW", "s3cret")
        a = syncer(server, passwordFile=str(tmp_path / "pw"))
        b = syncer(server, passwordEnv="EPP_TEST_REDIS_PW", db=1)
        c = syncer(server, passwordEnv="EPP_TEST_REDIS_PW")
        a.set(KEY, "ns/e1", [1, 1])
        b.set(KEY, "ns/e1", [9, 9])
        await rounds(a, b, c)
        assert c.get(KEY, "ns/e1", fold_sum) == [1, 1]  # b's database is another store
        wrong = syncer(server)  # no password
        refused = _metrics.FAILURES.labels("connection").value
        with pytest.raises(RedisError):  # refused: counted, and the caller goes on
            await wrong.sync()
        assert _metrics.FAILURES.labels("connection").value == refused + 1
        assert wrong.peers() == frozenset()
        for s in (a, b, c, wrong):
            await s.close()
    finally:
        server.stop()


async def test_pools_share_one_connection_per_redis(redis_server: RedisServer) -> None:
    """An EPP serving several pools has a syncer per pool: with the same connection settings they
    use one connection (counted by the server's CLIENT LIST), their rounds pipelined on it, their
    keys still per pool; other settings (another database) get a connection of their own."""
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    me = raw.client_id()

    def clients() -> int:
        return sum(1 for c in raw.client_list() if int(c["id"]) != me)

    pools = [f"ns/pool-{i}" for i in range(6)]
    first = [syncer(redis_server) for _ in pools]
    second = [syncer(redis_server) for _ in pools]  # a second replica of each pool
    for i, pool in enumerate(pools):
        for s in (first[i], second[i]):
            s.bind(pool, 0.5)
            s.set(KEY, "ns/e1", [i, 1])
    for _ in range(2):  # concurrent rounds, as the pools' sync loops run
        await asyncio.gather(*(s.sync() for s in first + second))
    assert clients() == 1
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a.peers() == {b.replica_id}  # only its own pool's replicas
        assert a.get(KEY, "ns/e1", fold_sum) == [2 * i, 2]
    assert {k.decode().split(":")[1] for k in raw.keys("llm-d-epp:ns/pool-*:replicas")} == set(pools)

    other_db = syncer(redis_server, db=1)
    other_db.bind("ns/pool-0", 0.5)
    await other_db.sync()
    assert clients() == 2
    assert other_db.peers() == frozenset()  # another database: nothing shared
    await other_db.close()
    await until(lambda: clients() == 1)

    # an error reply reaches only its own caller: the script is flushed, every syncer reloads it
    raw.script_flush()
    await asyncio.gather(*(s.sync() for s in first))
    assert clients() == 1
    # the server drops the connection: the next rounds connect again, still one connection
    raw.client_kill_filter(_type="normal", skipme=True)
    for s in first + second:
        try:
            await s.sync()
        except (RedisError, OSError):
            pass  # the round that met the closed connection
    await asyncio.gather(*(s.sync() for s in first + second))
    assert clients() == 1
    for s in first + second:
        await s.close()
    await until(lambda: clients() == 0)
    raw.close()
