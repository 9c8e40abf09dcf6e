"""Warm standbys: the leader's prefix-index updates reach a follower over the replication stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import orjson
import pytest

from epp.framework import ReplicatedState
from epp.server.replication import METHOD, ReplicationFollower, ReplicationHub
from epp.server.tls import (
    REPLICA_NAME,
    Authority,
    KeyPair,
    replica_channel_credentials,
    replica_server_credentials,
)
from tests.unit.factories import endpoints
from tests.unit.polling import until
from tests.unit.test_prefix_cache import SMALL, completion, infos, producer, route

PROMPT = "You are a helpful assistant. " * 8 + "Question one?"


@pytest.fixture
async def leader_server() -> AsyncIterator[tuple[ReplicationHub, str, object]]:
    leader_plugin = producer(**SMALL)
    hub = ReplicationHub({"prefix": leader_plugin}, interval=0.01)
    server = grpc.aio.server()
    hub.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    hub.start()
    yield hub, f"127.0.0.1:{port}", leader_plugin
    await hub.stop()
    await server.stop(0)


def test_the_prefix_producer_is_a_replicated_state_that_records_only_when_asked() -> None:
    plugin = producer(**SMALL)
    assert isinstance(plugin, ReplicatedState)
    assert plugin.take_updates() == []


async def test_recording_starts_only_when_asked_and_updates_drain_once() -> None:
    plugin = producer(**SMALL)
    eps = endpoints(2)
    await route(plugin, completion(PROMPT), eps, eps[0])
    assert plugin.take_updates() == []  # not recording: nothing kept
    plugin.start_recording()
    await route(plugin, completion(PROMPT + " more"), eps, eps[1])
    (update,) = plugin.take_updates()
    assert update[1] == eps[1].metadata.key and len(update[0]) > 3
    assert plugin.take_updates() == []


async def test_follower_mirrors_the_leaders_index(leader_server: tuple[ReplicationHub, str, object]) -> None:
    hub, address, leader_plugin = leader_server
    standby_plugin = producer(**SMALL)
    follower = ReplicationFollower({"prefix": standby_plugin}, lambda: address, recheck=0.1)
    follower.start()
    try:
        await until(lambda: hub.followers == 1)
        eps = endpoints(3)
        for i, target in enumerate(eps):  # the leader routes three prompt groups
            await route(leader_plugin, completion(f"group {i}: " + PROMPT), eps, target)  # type: ignore[arg-type]
        await until(lambda: standby_plugin.index.size() == leader_plugin.index.size() > 0)  # type: ignore[attr-defined]
        # the standby now predicts the same endpoint for each group
        for i, target in enumerate(eps):
            cycle = await route(
                standby_plugin, completion(f"group {i}: " + PROMPT + " next turn"), eps, target
            )
            matches = infos(cycle, eps)
            best = max(range(3), key=lambda j: matches[j][0])
            assert best == i and matches[i][0] > 0, matches
        assert follower.batches_applied >= 1 and hub.batches_sent >= 1
    finally:
        await follower.stop()


async def test_follower_stops_following_when_it_leads_and_reconnects_after_a_leader_restart(
    leader_server: tuple[ReplicationHub, str, object],
) -> None:
    hub, address, _ = leader_server
    target: list[str | None] = [address]
    follower = ReplicationFollower({"prefix": producer(**SMALL)}, lambda: target[0], recheck=0.05)
    follower.start()
    try:
        await until(lambda: follower.following == address and hub.followers == 1)
        target[0] = None  # we became the leader
        await until(lambda: follower.following is None and hub.followers == 0)
        target[0] = "127.0.0.1:1"  # a leader that is not reachable: retried, never crashes
        await asyncio.sleep(0.3)
        assert follower.following is None
        target[0] = address
        await until(lambda: follower.following == address and hub.followers == 1)
    finally:
        await follower.stop()


async def test_a_follower_that_falls_behind_is_cut_off_to_resync_instead_of_diverging(
    leader_server: tuple[ReplicationHub, str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    from epp.server import replication

    hub, _, leader_plugin = leader_server
    await hub.stop()  # drive flushes by hand
    monkeypatch.setattr(replication, "MAX_PENDING_BYTES", 600)
    slow = replication._Follower()
    hub._followers.add(slow)
    eps = endpoints(2)
    for i in range(6):
        await route(leader_plugin, completion(f"{i} " + PROMPT), eps, eps[0])  # type: ignore[arg-type]
        hub.flush()
    queued = [slow.queue.get_nowait() for _ in range(slow.queue.qsize())]
    assert queued[-1] is None and all(isinstance(m, bytes) for m in queued[:-1])  # cut, not trimmed
    assert sum(len(m) for m in queued[:-1] if m) <= 600 and hub.followers_cut == 1
    hub.flush()  # nothing more is queued for a follower that was cut off
    assert slow.queue.empty()


def test_batches_are_split_below_the_message_limit() -> None:
    from epp.server.replication import encode

    updates = [[list(range(i, i + 50)), f"ns/e{i}", 100] for i in range(40)]
    messages = encode("prefix", updates, limit=2000)
    assert len(messages) > 1 and all(len(m) <= 2000 for m in messages)
    decoded = [u for m in messages for u in orjson.loads(m)["prefix"]]
    assert decoded == updates  # order kept, nothing lost or repeated
    (single,) = encode("prefix", updates[:1], limit=10)  # one update is never split
    assert orjson.loads(single) == {"prefix": updates[:1]}


async def test_only_the_leader_serves_the_stream() -> None:
    from epp.server import replication

    leading = [False]
    hub = ReplicationHub({"prefix": producer(**SMALL)}, is_leader=lambda: leading[0])
    server = grpc.aio.server()
    hub.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in channel.unary_stream(replication.METHOD)(b""):
                    pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            leading[0] = True
            call = channel.unary_stream(replication.METHOD)(b"")
            first = await call.read()
            assert orjson.loads(first) == {"$reset": True}
            call.cancel()
    finally:
        await server.stop(0)


def test_index_export_rebuilds_the_same_index_lru_order_included() -> None:
    from epp.plugins.producers._prefix_index import PrefixIndex

    src = PrefixIndex()
    src.add([1, 2, 3, 4], "a", 5)
    src.add([3, 9], "b", 3)
    src.add([7, 8], "a", 5)  # a's LRU overflows: 4 and 3 are evicted (tail first)
    src.add([2], "a", 5)  # touch
    dst = PrefixIndex()
    dst.add([42], "stale", 1)
    dst.clear()
    for hashes, key, capacity in src.export(chunk=2):
        dst.add(hashes, key, capacity)
    assert list(dst.export()) == list(src.export())
    assert dst.size() == src.size() and dst.hash_count() == src.hash_count()
    assert dst.match([1, 2]) == src.match([1, 2]) and dst.holders(3) == src.holders(3)
    # the next eviction drops the same entry on both
    src.add([100], "a", 5)
    dst.add([100], "a", 5)
    assert list(dst.export()) == list(src.export())


async def test_a_late_follower_gets_a_snapshot_first(
    leader_server: tuple[ReplicationHub, str, object],
) -> None:
    _, address, leader_plugin = leader_server
    eps = endpoints(3)
    for i, target in enumerate(eps):  # state built before anyone follows
        await route(leader_plugin, completion(f"early {i}: " + PROMPT), eps, target)  # type: ignore[arg-type]
    standby_plugin = producer(**SMALL)
    await route(standby_plugin, completion("stale standby state " + PROMPT), eps, eps[0])
    follower = ReplicationFollower({"prefix": standby_plugin}, lambda: address, recheck=0.1)
    follower.start()
    try:
        index, mirror = leader_plugin.index, standby_plugin.index  # type: ignore[attr-defined]
        await until(lambda: list(mirror.export()) == list(index.export()))
        await route(leader_plugin, completion("late: " + PROMPT), eps, eps[2])  # type: ignore[arg-type]
        await until(lambda: list(mirror.export()) == list(index.export()))
    finally:
        await follower.stop()


async def test_followers_beyond_the_limit_are_refused(
    leader_server: tuple[ReplicationHub, str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    from epp.server import replication

    hub, address, _ = leader_server
    monkeypatch.setattr(replication, "MAX_FOLLOWERS", 1)
    first = ReplicationFollower({"prefix": producer(**SMALL)}, lambda: address, recheck=0.1)
    first.start()
    try:
        await until(lambda: hub.followers == 1)
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_stream(replication.METHOD)(b"")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert hub.followers == 1
    finally:
        await first.stop()


# ------------------------------------------------------------------------ mutual TLS (replicas only)


def _write_pair(directory: Path, pair: KeyPair) -> str:
    directory.mkdir(parents=True)
    (directory / "tls.crt").write_bytes(pair.cert)
    (directory / "tls.key").write_bytes(pair.key)
    (directory / "ca.crt").write_bytes(pair.ca or b"")
    return str(directory)


@pytest.fixture(scope="module")
def authorities() -> tuple[Authority, Authority]:
    return Authority.create("replicas"), Authority.create("someone-else")


@pytest.fixture
async def tls_leader(
    tmp_path: Path, authorities: tuple[Authority, Authority]
) -> AsyncIterator[tuple[ReplicationHub, str, Authority]]:
    """A leader's hub on a mutual-TLS port, as ``epp serve`` runs it."""
    ca, _ = authorities
    leader_dir = _write_pair(
        tmp_path / "leader", ca.issue("epp", dns_names=["epp", REPLICA_NAME], client=True)
    )
    hub = ReplicationHub({"prefix": producer(**SMALL)}, interval=0.01, peer_name=REPLICA_NAME)
    server = grpc.aio.server()
    hub.add_to_server(server)
    port = server.add_secure_port("127.0.0.1:0", replica_server_credentials(leader_dir))
    await server.start()
    hub.start()
    yield hub, f"127.0.0.1:{port}", ca
    await hub.stop()
    await server.stop(0)


async def _first_message(address: str, credentials: grpc.ChannelCredentials | None) -> bytes:
    options = [("grpc.ssl_target_name_override", REPLICA_NAME)]
    channel = (
        grpc.aio.secure_channel(address, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        call = channel.unary_stream(METHOD)(b"", timeout=5)
        try:
            return bytes(await call.read())
        finally:
            call.cancel()


async def test_the_replication_port_refuses_peers_that_are_not_replicas(
    tls_leader: tuple[ReplicationHub, str, Authority], authorities: tuple[Authority, Authority]
) -> None:
    hub, address, ca = tls_leader
    _, other = authorities
    # plain text, and TLS without a client certificate: no handshake
    for credentials in (None, grpc.ssl_channel_credentials(root_certificates=ca.cert)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _first_message(address, credentials)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # a client certificate from another CA: refused in the handshake
    stranger = other.issue("x", dns_names=[REPLICA_NAME], server=False, client=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _first_message(
            address,
            grpc.ssl_channel_credentials(ca.cert, private_key=stranger.key, certificate_chain=stranger.cert),
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # a client certificate from the replicas' CA that is not a replica's (Envoy's)
    envoy = ca.issue("envoy", server=False, client=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _first_message(
            address,
            grpc.ssl_channel_credentials(ca.cert, private_key=envoy.key, certificate_chain=envoy.cert),
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert hub.refused == 1 and hub.followers == 0
    # a replica's certificate: served
    replica = ca.issue("epp", dns_names=[REPLICA_NAME], client=True)
    first = await _first_message(
        address,
        grpc.ssl_channel_credentials(ca.cert, private_key=replica.key, certificate_chain=replica.cert),
    )
    assert orjson.loads(first) == {"$reset": True}


async def test_a_standby_follows_the_leader_over_mutual_tls(
    tls_leader: tuple[ReplicationHub, str, Authority], tmp_path: Path
) -> None:
    hub, address, ca = tls_leader
    standby_dir = _write_pair(tmp_path / "standby", ca.issue("epp", dns_names=[REPLICA_NAME], client=True))
    follower = ReplicationFollower(
        {"prefix": producer(**SMALL)},
        lambda: address,
        recheck=0.1,
        credentials=lambda: replica_channel_credentials(standby_dir),
        server_name=REPLICA_NAME,
    )
    follower.start()
    try:
        await until(lambda: follower.following == address and hub.followers == 1)
    finally:
        await follower.stop()


async def test_a_standby_does_not_follow_a_leader_it_cannot_verify(
    tmp_path: Path, authorities: tuple[Authority, Authority]
) -> None:
    ca, other = authorities
    # the "leader" holds a certificate of another CA (it would feed the standby its own state)
    impostor_dir = _write_pair(
        tmp_path / "impostor", other.issue("epp", dns_names=[REPLICA_NAME], client=True)
    )
    hub = ReplicationHub({"prefix": producer(**SMALL)}, interval=0.01)
    server = grpc.aio.server()
    hub.add_to_server(server)
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials(
            [(Path(impostor_dir, "tls.key").read_bytes(), Path(impostor_dir, "tls.crt").read_bytes())]
        ),
    )
    await server.start()
    standby_dir = _write_pair(tmp_path / "standby", ca.issue("epp", dns_names=[REPLICA_NAME], client=True))
    follower = ReplicationFollower(
        {"prefix": producer(**SMALL)},
        lambda: f"127.0.0.1:{port}",
        recheck=0.05,
        credentials=lambda: replica_channel_credentials(standby_dir),
        server_name=REPLICA_NAME,
    )
    follower.start()
    try:
        await asyncio.sleep(1.0)
        assert follower.following is None and follower.batches_applied == 0 and hub.followers == 0
    finally:
        await follower.stop()
        await server.stop(0)
