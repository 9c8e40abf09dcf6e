"""Cross-replica sync: every ``crossReplicaSyncInterval`` the contributors' shared state goes out
through the syncer and the peers' state comes back into the contributors, off the request path.

One task: publish (``SharedValue.supply`` → ``set``/``delete``; ``SharedLog.take`` → ``append``),
one ``sync`` round trip bounded by ``publishTimeout``, then install (the peers' folded values,
their records). A failed round leaves every contributor with its local state (the syncer logs and
counts it); the next round retries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import structlog

from epp.background import BackgroundTask
from epp.framework.cross_replica import CrossReplicaSpec, CrossReplicaSyncer, SharedLog, SharedValue

log = structlog.get_logger("epp.cross_replica")


class CrossReplicaRuntime:
    """Runs the sync loop of one syncer over the contributors' specs."""

    def __init__(
        self,
        syncer: CrossReplicaSyncer,
        specs: Sequence[CrossReplicaSpec],
        *,
        pool: str,
        interval: float,
        publish_timeout: float | None = None,
    ) -> None:
        self.syncer = syncer
        self.values = [s for s in specs if isinstance(s, SharedValue)]
        self.logs = [s for s in specs if isinstance(s, SharedLog)]
        self.interval = max(0.005, interval)
        timeout = publish_timeout if publish_timeout else max(self.interval, 0.5)
        syncer.bind(pool, timeout)
        for spec in self.logs:
            syncer.subscribe(spec.state_key)
        self._published: dict[str, set[str]] = {s.state_key: set() for s in self.values}
        # per value spec: the peers' values last folded (the syncer's mapping, by identity) and the
        # fold; a syncer that keeps its mapping while no peer's value changed saves the fold
        self._folded: list[tuple[object, dict[str, Any]]] = [(None, {}) for _ in self.values]
        self._task = BackgroundTask("cross-replica-sync", self._run)
        self.rounds = 0

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        await self.syncer.close()

    async def _run(self) -> None:
        while True:
            began = time.monotonic()
            await self.step()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    async def step(self) -> bool:
        """One round: publish, sync, install. False when the store could not be reached."""
        self._publish()
        ok = True
        try:
            await self.syncer.sync()
        except asyncio.CancelledError:
            raise
        except Exception:  # logged and counted by the syncer: keep the local state and go on
            ok = False
        self._install()
        self.rounds += 1
        return ok

    def _publish(self) -> None:
        syncer = self.syncer
        for spec in self.values:
            try:
                current = spec.supply()
            except Exception as e:
                log.error("cross-replica supply failed", state=spec.state_key, error=repr(e))
                continue
            key = spec.state_key
            for endpoint, value in current.items():
                syncer.set(key, endpoint, value)
            before = self._published[key]
            for endpoint in before - current.keys():
                syncer.delete(key, endpoint)
            self._published[key] = set(current)
        for lspec in self.logs:
            records = lspec.take()
            if records:
                syncer.append(lspec.state_key, records)

    def _install(self) -> None:
        syncer = self.syncer
        for i, spec in enumerate(self.values):
            peer_values = syncer.peer_values(spec.state_key)
            seen, folded = self._folded[i]
            if peer_values is not seen:
                folded = {}
                invalid = 0
                for endpoint, values in peer_values.items():
                    good = [v for v in values if spec.valid(v)]
                    invalid += len(values) - len(good)
                    if good:
                        folded[endpoint] = spec.aggregate(good)
                if invalid:
                    syncer.skip("invalid", invalid)
                self._folded[i] = (peer_values, folded)
            try:
                spec.install(folded)
            except Exception as e:
                log.error("cross-replica install failed", state=spec.state_key, error=repr(e))
        for lspec in self.logs:
            records = syncer.take_records(lspec.state_key)
            if not records:
                continue
            good = [r for r in records if lspec.valid(r)]
            if len(good) < len(records):
                syncer.skip("invalid", len(records) - len(good))
            if good:
                try:
                    lspec.apply(good)
                except Exception as e:
                    log.error("cross-replica apply failed", state=lspec.state_key, error=repr(e))
