"""Warm standbys: the leader streams its plugins' learned-state updates to the other replicas.

``ReplicationHub`` serves the leader's batches over gRPC (mutual TLS, replicas only);
``ReplicationFollower`` applies them on every other replica.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import orjson
import structlog

from epp.background import BackgroundTask
from epp.framework import ReplicatedState
from epp.server.tls import peer_names

log = structlog.get_logger("epp.replication")

SERVICE = "epp.replication.v1.Replication"
METHOD = f"/{SERVICE}/Follow"
FLUSH_INTERVAL = 0.05
MAX_PENDING_BYTES = 32 << 20  # per follower: one that falls further behind is cut off and resyncs
MAX_MESSAGE_BYTES = 1 << 20  # batches are split below gRPC's 4 MiB default message limit
MAX_FOLLOWERS = 16  # standbys of one pool; more connections are refused
RESET_KEY = "$reset"
RESET = orjson.dumps({RESET_KEY: True})


def _identity(b: bytes) -> bytes:
    return b


def encode(name: str, updates: list[Any], limit: int = MAX_MESSAGE_BYTES) -> list[bytes]:
    """``{name: updates}`` as messages of at most ``limit`` bytes (halving; one update is never split)."""
    data = orjson.dumps({name: updates})
    if len(data) <= limit or len(updates) <= 1:
        return [data]
    half = len(updates) // 2
    return encode(name, updates[:half], limit) + encode(name, updates[half:], limit)


class _Follower:
    """One connected standby: its pending messages (``None`` = cut off: it fell too far behind)."""

    __slots__ = ("pending_bytes", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.pending_bytes = 0


class ReplicationHub:
    """Drains the replicated plugins and fans the batches out to the connected followers.

    Every 50 ms the updates go out as orjson messages ``{"<plugin name>": [update, ...]}`` of at most
    1 MiB; a new follower first gets ``{"$reset": true}`` and a snapshot. A follower more than 32 MiB
    behind is cut off (it reconnects and resyncs), so the leader never slows down. Only the leader
    serves the stream (``is_leader``): a replica that restarted in place under the leader's address, or
    a standby, answers FAILED_PRECONDITION instead of resetting the standbys' warm state with its own
    empty one. With ``peer_name`` (on a mutual-TLS port) a follower whose verified certificate does
    not name it is answered PERMISSION_DENIED.
    """

    def __init__(
        self,
        plugins: Mapping[str, ReplicatedState],
        *,
        is_leader: Callable[[], bool] = lambda: True,
        interval: float = FLUSH_INTERVAL,
        peer_name: str | None = None,
    ) -> None:
        self.plugins = dict(plugins)
        self.is_leader = is_leader
        self.peer_name = peer_name
        self.refused = 0
        self.interval = interval
        self.batches_sent = 0
        self.followers_cut = 0
        self._followers: set[_Follower] = set()
        self._task = BackgroundTask("replication hub", self._run)
        for plugin in self.plugins.values():
            plugin.start_recording()

    @property
    def followers(self) -> int:
        return len(self._followers)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_stream_rpc_method_handler(
            self._follow, request_deserializer=_identity, response_serializer=_identity
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Follow": handler}),))

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    def flush(self) -> None:
        """Drain every plugin once and queue the batch for each follower (also called by tests)."""
        messages: list[bytes] = []
        for name, plugin in self.plugins.items():
            updates = plugin.take_updates()
            if updates:
                messages += encode(name, updates)
        if not messages or not self._followers:
            return  # nobody to tell: updates are dropped, the standbys are not listening
        size = sum(map(len, messages))
        for follower in self._followers:
            if follower.pending_bytes < 0:
                continue  # already cut off
            if follower.pending_bytes + size > MAX_PENDING_BYTES:
                # Dropping batches would leave it silently different from the leader: cut it off,
                # it reconnects and starts again from a snapshot.
                follower.pending_bytes = -1
                follower.queue.put_nowait(None)
                self.followers_cut += 1
                continue
            follower.pending_bytes += size
            for message in messages:
                follower.queue.put_nowait(message)
        self.batches_sent += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.flush()
            except Exception:  # a plugin's bug must not stop replication for the others
                log.exception("replication flush failed")

    async def _follow(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if self.peer_name is not None and self.peer_name not in peer_names(context.auth_context()):
            self.refused += 1
            log.warning("replication refused: the peer's certificate is not a replica's", peer=context.peer())
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"a replica certificate ({self.peer_name}) is required"
            )
        if not self.is_leader():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not the leader")
        if len(self._followers) >= MAX_FOLLOWERS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_FOLLOWERS} followers")
        follower = _Follower()
        self._followers.add(follower)  # from now on, live batches queue up behind the snapshot
        log.info("standby following", peer=context.peer(), followers=len(self._followers))
        try:
            # The snapshot is produced lazily, one chunk per message: each write yields to the
            # event loop, so a large index never stalls the requests the leader is routing.
            yield RESET
            for name, plugin in self.plugins.items():
                for part in plugin.snapshot_updates():
                    for message in encode(name, part):
                        yield message
            while True:
                live = await follower.queue.get()
                if live is None:
                    log.warning("standby fell behind; cutting it off to resync", peer=context.peer())
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fell behind; resync")
                    return
                follower.pending_bytes -= len(live)
                yield live
        finally:
            self._followers.discard(follower)
            log.info("standby left", peer=context.peer(), followers=len(self._followers))


class ReplicationFollower:
    """Follows ``leader_address()`` (None: we lead, or no leader known) and applies its batches.

    ``credentials`` (called on every connection, so renewed files apply) makes the channel mutual
    TLS; the leader's certificate must then name ``server_name``. Without it the channel is plain
    text (tests only).
    """

    def __init__(
        self,
        plugins: Mapping[str, ReplicatedState],
        leader_address: Callable[[], str | None],
        *,
        recheck: float = 1.0,
        credentials: Callable[[], grpc.ChannelCredentials] | None = None,
        server_name: str = "",
    ) -> None:
        self.plugins = dict(plugins)
        self.leader_address = leader_address
        self.recheck = recheck
        self.credentials = credentials
        self.server_name = server_name
        self.batches_applied = 0
        self.following: str | None = None  # the leader whose stream is being received
        self._task = BackgroundTask("replication follower", self._run)
        self._rng = random.Random()

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        failures = 0
        while True:
            address = self.leader_address()
            if not address:
                await asyncio.sleep(self.recheck / 2)
                continue
            try:
                await self._follow(address)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # leader gone, restarting, not yet serving: try again
                failures += 1
                log.info("replication stream ended", leader=address, error=str(e) or type(e).__name__)
            finally:
                self.following = None
            await asyncio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6)) * self._rng.uniform(0.8, 1.2))

    def _channel(self, address: str) -> grpc.aio.Channel:
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 << 20)]
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(address, self.credentials(), options=options)

    async def _follow(self, address: str) -> None:
        async with self._channel(address) as channel:
            call = channel.unary_stream(
                METHOD, request_serializer=_identity, response_deserializer=_identity
            )(b"")
            reader = asyncio.get_running_loop().create_task(self._read(call, address))
            try:
                while True:
                    done, _ = await asyncio.wait({reader}, timeout=self.recheck)
                    if done:
                        reader.result()  # the stream ended: raise its error, if any
                        return
                    if self.leader_address() != address:
                        return  # the leader changed (or we lead now)
            finally:
                call.cancel()
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, call: Any, address: str) -> None:
        async for data in call:
            if self.following != address:  # the first message (the reset) proves the stream is up
                self.following = address
                log.info("following the leader", leader=address)
            self._apply(orjson.loads(data))

    def _apply(self, batch: dict[str, Any]) -> None:
        if batch.get(RESET_KEY):
            for name, replica in self.plugins.items():
                try:
                    replica.reset_replica()
                except Exception:
                    log.exception("resetting replicated state failed", plugin=name)
            return
        for name, updates in batch.items():
            plugin = self.plugins.get(name)
            if plugin is None:
                continue  # the leader runs a plugin we don't (a config change mid-rollout)
            try:
                plugin.apply_updates(updates)
            except Exception:
                log.exception("applying replicated updates failed", plugin=name)
        self.batches_applied += 1
