"""gRPC health (standard Health Checking Protocol) on ``--grpc-health-port``.

Service names ``""`` (overall), ``liveness``, ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor``. ``liveness`` is SERVING as soon as the process
runs; the others become SERVING once the endpoint store finished its initial load (the reference's
"datastore synced"), and go NOT_SERVING during graceful shutdown.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXTPROC_SERVICE)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self) -> None:
        self.servicer = HealthServicer()

    async def start(self) -> None:
        await self.servicer.set("liveness", SERVING)
        for name in READY_SERVICES:
            await self.servicer.set(name, NOT_SERVING)

    async def set_ready(self, ready: bool) -> None:
        for name in READY_SERVICES:
            await self.servicer.set(name, SERVING if ready else NOT_SERVING)

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()
