"""gRPC health (standard Health Checking Protocol) on ``--grpc-health-port``.

Readiness is the conjunction of named conditions (``pool``, ``leader``, ``serving``); degradations
are reported but do not gate it.
"""

from __future__ import annotations

import asyncio

import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The service name the llm-d Helm chart's single-replica liveness and readiness probes send.
CHART_SERVICE = "inference-extension"
READY_SERVICES = ("", "readiness", EXTPROC_SERVICE, CHART_SERVICE)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = structlog.get_logger("epp.health")


class Health:
    """Readiness conditions and degradations behind the gRPC health service.

    ``""``, ``readiness``, ``inference-extension`` and the ext_proc service name are SERVING only
    while every condition holds (``pool`` synced, ``leader`` when electing, ``serving``);
    ``liveness`` as soon as the process runs.
    ``reasons()`` names what is missing; degradations (``set_degraded``) are logged, never gate it.
    """

    def __init__(self, *, leader_election: bool = False) -> None:
        self.servicer = HealthServicer()
        self._conditions: dict[str, tuple[bool, str]] = {
            "pool": (False, "endpoints not loaded yet"),
            "leader": (not leader_election, "not the leader" if leader_election else ""),
            "serving": (False, "ext_proc server not started"),
        }
        self._degraded: dict[str, str] = {}
        self._published: bool | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return all(ok for ok, _ in self._conditions.values())

    @property
    def serving(self) -> bool:
        """What the gRPC health service says now (``/readyz`` on the metrics port)."""
        return self._published is True

    def reasons(self) -> list[str]:
        return [f"{name}: {why}" for name, (ok, why) in self._conditions.items() if not ok]

    def degraded(self) -> list[str]:
        return [f"{name}: {why}" for name, why in self._degraded.items()]

    def set_degraded(self, name: str, reason: str) -> None:
        """Record (``reason``) or clear (``""``) a degradation; readiness is unchanged."""
        if self._degraded.get(name, "") == reason:
            return
        if reason:
            self._degraded[name] = reason
            log.warning("readiness degraded", serving=self.ready, degraded=self.degraded())
        else:
            self._degraded.pop(name, None)
            log.warning("readiness recovered", condition=name, serving=self.ready, degraded=self.degraded())

    async def start(self) -> None:
        await self.servicer.set("liveness", SERVING)
        await self._publish()

    async def set_condition(self, name: str, ok: bool, reason: str = "") -> None:
        if name not in self._conditions:
            raise KeyError(name)
        self._conditions[name] = (ok, reason)
        await self._publish()

    def set_condition_soon(self, name: str, ok: bool, reason: str = "") -> None:
        """For synchronous callers (discovery, leader election) running on the event loop."""
        task = asyncio.get_running_loop().create_task(self.set_condition(name, ok, reason))
        self._pending.add(task)  # keep a reference until it ran (the loop holds only weak ones)
        task.add_done_callback(self._pending.discard)

    async def set_ready(self, ready: bool) -> None:
        """The server's own condition: up and not draining."""
        await self.set_condition("serving", ready, "" if ready else "shutting down or not started")

    async def _publish(self) -> None:
        async with self._lock:  # publish in order; the final state always wins
            ready = self.ready
            if ready == self._published:
                return
            self._published = ready
            for name in READY_SERVICES:
                await self.servicer.set(name, SERVING if ready else NOT_SERVING)
            log.info("readiness", serving=ready, missing=self.reasons(), degraded=self.degraded())

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()
