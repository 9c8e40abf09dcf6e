"""gRPC health: service names and readiness semantics, and the drain on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.dev.stack import free_port, grpc_serving
from epp.server.health import Health
from tests.unit.extproc_harness import headers_msg

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# "inference-extension": what the llm-d Helm chart's single-replica probes send.
NAMES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension")


@pytest.fixture
async def health() -> AsyncIterator[tuple[Health, health_pb2_grpc.HealthStub]]:
    h = Health()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(h.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await h.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield h, health_pb2_grpc.HealthStub(channel)
    await channel.close()
    await server.stop(0)


async def _statuses(stub: health_pb2_grpc.HealthStub) -> dict[str, int]:
    return {n: (await stub.Check(health_pb2.HealthCheckRequest(service=n))).status for n in NAMES}


async def test_live_before_ready_then_ready_once_endpoints_loaded(
    health: tuple[Health, health_pb2_grpc.HealthStub],
) -> None:
    h, stub = health
    assert await _statuses(stub) == {
        "": NOT_SERVING,
        "liveness": SERVING,
        "readiness": NOT_SERVING,
        NAMES[3]: NOT_SERVING,
        "inference-extension": NOT_SERVING,
    }
    await h.set_ready(True)  # the server is up, but the pool has not synced
    assert (await _statuses(stub))["readiness"] == NOT_SERVING
    assert h.reasons() == ["pool: endpoints not loaded yet"]
    await h.set_condition("pool", True)
    assert set((await _statuses(stub)).values()) == {SERVING}
    await h.set_ready(False)
    assert (await _statuses(stub))["readiness"] == NOT_SERVING


async def test_with_leader_election_readiness_needs_leadership_and_liveness_does_not() -> None:
    h = Health(leader_election=True)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(h.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await h.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await h.set_condition("pool", True)
        await h.set_ready(True)
        statuses = await _statuses(stub)
        assert statuses["liveness"] == SERVING and statuses["readiness"] == NOT_SERVING
        assert statuses[NAMES[3]] == statuses["inference-extension"] == NOT_SERVING
        assert h.reasons() == ["leader: not the leader"]
        await h.set_condition("leader", True)
        assert set((await _statuses(stub)).values()) == {SERVING}
        await h.set_condition("leader", False, "not the leader")
        assert (await _statuses(stub))[NAMES[3]] == NOT_SERVING
        with pytest.raises(KeyError):
            await h.set_condition("bogus", True)
    await server.stop(0)


def test_sigterm_turns_readiness_off_and_keeps_serving_during_the_drain(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 1}\n")
    config = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- {{name: files, type: file-discovery, parameters: {{path: {endpoints}}}}}\n"
        "dataLayer: {discovery: {pluginRef: files}}\n"
    )
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epp",
            "serve",
            "--secure-serving=false",
            f"--grpc-port={grpc_port}",
            f"--grpc-health-port={health_port}",
            f"--metrics-port={metrics_port}",
            "--drain-delay=20s",
            "--grace-period=1s",
            "--config-text",
            config,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not grpc_serving(health_port):
            assert proc.poll() is None and time.monotonic() < deadline, "epp never became ready"
            time.sleep(0.05)
        assert grpc_serving(health_port, "liveness")
        os.kill(proc.pid, signal.SIGTERM)
        while grpc_serving(health_port):
            assert time.monotonic() < deadline, "readiness stayed SERVING after SIGTERM"
            time.sleep(0.05)
        # Draining: readiness is off, but a stream is still answered (a GET routed to the endpoint).
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            replies = stub.Process(iter([headers_msg({":method": "GET"}, end_of_stream=True)]), timeout=10)
            first = next(iter(replies))
        assert (
            first.request_headers.response.header_mutation.set_headers[0].header.raw_value == b"127.0.0.1:1"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""


async def test_degradation_is_reported_without_changing_readiness(
    health: tuple[Health, health_pb2_grpc.HealthStub],
) -> None:
    from structlog.testing import capture_logs

    h, stub = health
    await h.set_condition("pool", True)
    await h.set_ready(True)
    with capture_logs() as logs:
        h.set_degraded("discovery", "endpoints file rejected (x); serving the last good set of 2 endpoints")
        h.set_degraded("discovery", "endpoints file rejected (x); serving the last good set of 2 endpoints")
        assert set((await _statuses(stub)).values()) == {SERVING}  # still ready
        assert h.degraded() == [
            "discovery: endpoints file rejected (x); serving the last good set of 2 endpoints"
        ]
        assert h.reasons() == []
        h.set_degraded("discovery", "")
    assert h.degraded() == []
    assert [e["event"] for e in logs] == ["readiness degraded", "readiness recovered"]  # changes only
    assert logs[0]["serving"] is True
    assert logs[0]["degraded"] == [
        "discovery: endpoints file rejected (x); serving the last good set of 2 endpoints"
    ]
