"""One failed Envoy -> EPP health check (an EPP answering late on CPUs it shares with engines)
must not eject the EPP: through a real Envoy on the generated bootstrap, whose health checks go to
a gRPC health server this test controls, and the real EPP serving ext_proc."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.dev import stack
from tests.integration.harness import Envoy, Rig, chat_body, marker

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
LATE = 2.5  # seconds: beyond the checks' timeout (2 s; 1 s before)


class OneMiss(health_pb2_grpc.HealthServicer):
    """SERVING, but after ``miss()`` one answer comes later than the checks' timeout (a NOT_SERVING
    ejects at once, by design: that is the EPP saying so); the check after it waits for
    ``release`` (so the test reads Envoy's view between the miss and the next answer)."""

    def __init__(self) -> None:
        self.count = 0
        self.fail_at = -1
        self.release = threading.Event()
        self._lock = threading.Lock()

    def miss(self) -> None:
        with self._lock:
            self.fail_at = self.count

    def Check(self, request: Any, context: Any) -> Any:
        with self._lock:
            n, self.count = self.count, self.count + 1
        if n == self.fail_at:
            time.sleep(LATE)
        if n == self.fail_at + 1:
            self.release.wait(1.5)  # below the checks' timeout
        return health_pb2.HealthCheckResponse(status=SERVING)


def _failures(envoy: Envoy) -> int:
    return envoy.stat("cluster.ext_proc.health_check.failure")


def test_one_failed_health_check_does_not_eject_the_epp(rig: Rig) -> None:
    sims = rig.start_sims(1)
    epp = rig.start_epp(sims)
    health = OneMiss()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = stack.free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        envoy = rig.start_envoy(epp, extproc_health_port=port)
        before = _failures(envoy)
        health.miss()
        deadline = 100
        while _failures(envoy) == before:
            deadline -= 1
            assert deadline > 0, "the failed check was never counted"
            time.sleep(0.05)
        flags = envoy.health_flags("ext_proc")
        status = envoy.post("/v1/chat/completions", chat_body(marker())).status
        health.release.set()
        assert not any("failed_active_hc" in f for f in flags), flags
        assert status == 200
    finally:
        health.release.set()
        server.stop(0)
