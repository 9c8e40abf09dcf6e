"""Warm standbys: the leader streams its plugins' learned-state updates to the other replicas.

With ``--ha-enable-leader-election`` only the leader routes, so only its request hooks learn (the
approximate prefix index records where each prompt went). Without help a standby that becomes
leader would start with an empty index and send every known prefix to an arbitrary endpoint once
(one cache miss per prompt group or chat session). Here:

* every replica's ``ReplicatedState`` plugins record their updates (``start_recording``);
* ``ReplicationHub`` (every replica; only the leader has updates) drains them every 50 ms and sends
  one batch to each connected follower over gRPC on the health port:
  ``/epp.replication.v1.Replication/Follow``, server streaming, each message an orjson object
  ``{"<plugin name>": [update, ...]}``. A new follower first gets ``{"$reset": true}`` and a
  snapshot of the current state (``snapshot_updates``, in batches), then the live batches. A
  follower that cannot keep up loses its oldest live batches (bounded queue; counted), never
  slowing the leader;
* ``ReplicationFollower`` (every replica) connects to the leader's advertised address (from the
  Lease, see ``epp.k8s.leader``) while it is not the leader itself, applies each batch, and
  reconnects with backoff when the stream breaks or the leader changes.

Updates are applied in the leader's order, so a follower's state equals the leader's (a record the
snapshot already contains may be applied again: ``add`` is idempotent but for recency). Nothing
here runs per request: the request hooks only append to a list.
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

log = structlog.get_logger("epp.replication")

SERVICE = "epp.replication.v1.Replication"
METHOD = f"/{SERVICE}/Follow"
FLUSH_INTERVAL = 0.05
QUEUE_BATCHES = 512  # per follower; about 25 s of batches at the flush interval
MAX_FOLLOWERS = 16  # standbys of one pool; more connections are refused (the port is unauthenticated)
RESET_KEY = "$reset"
RESET = orjson.dumps({RESET_KEY: True})


def _identity(b: bytes) -> bytes:
    return b


class ReplicationHub:
    """Drains the replicated plugins and fans the batches out to the connected followers."""

    def __init__(self, plugins: Mapping[str, ReplicatedState], *, interval: float = FLUSH_INTERVAL) -> None:
        self.plugins = dict(plugins)
        self.interval = interval
        self.batches_sent = 0
        self.batches_dropped = 0
        self._followers: set[asyncio.Queue[bytes]] = set()
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
        batch = {}
        for name, plugin in self.plugins.items():
            updates = plugin.take_updates()
            if updates:
                batch[name] = updates
        if not batch or not self._followers:
            return  # nobody to tell: updates are dropped, the standbys are not listening
        data = orjson.dumps(batch)
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()
                self.batches_dropped += 1
            queue.put_nowait(data)
        self.batches_sent += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.flush()
            except Exception:  # a plugin's bug must not stop replication for the others
                log.exception("replication flush failed")

    async def _follow(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if len(self._followers) >= MAX_FOLLOWERS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_FOLLOWERS} followers")
        queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_BATCHES)
        self._followers.add(queue)  # from now on, live batches queue up behind the snapshot
        log.info("standby following", peer=context.peer(), followers=len(self._followers))
        try:
            # The snapshot is produced lazily, one chunk per message: each write yields to the
            # event loop, so a large index never stalls the requests the leader is routing.
            yield RESET
            for name, plugin in self.plugins.items():
                for part in plugin.snapshot_updates():
                    yield orjson.dumps({name: part})
            while True:
                yield await queue.get()
        finally:
            self._followers.discard(queue)
            log.info("standby left", peer=context.peer(), followers=len(self._followers))


class ReplicationFollower:
    """Follows ``leader_address()`` (None: we lead, or no leader known) and applies its batches."""

    def __init__(
        self,
        plugins: Mapping[str, ReplicatedState],
        leader_address: Callable[[], str | None],
        *,
        recheck: float = 1.0,
    ) -> None:
        self.plugins = dict(plugins)
        self.leader_address = leader_address
        self.recheck = recheck
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

    async def _follow(self, address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
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
