"""Readiness probes of the local stack: free ports, HTTP and gRPC health checks, bounded waits."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from epp.dev.stack.supervisor import Child, ChildExited

READY_TIMEOUT = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free right now."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports that are free right now (for ``sim_base_port``)."""
    for _ in range(50):
        base = free_port(host)
        if base + count < 65536 and not any(port_in_use(base + i, host) for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free ports")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def http_status(url: str, timeout: float = 2.0, host: str = "") -> int | None:
    """Status of ``GET url`` (with ``host``: that ``Host`` header); None when the connection fails."""
    try:
        req = urllib.request.Request(url, headers={"Host": host} if host else {})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return None


def http_ok(url: str, host: str = "") -> Callable[[], bool]:
    """A check for :func:`wait_until`: ``GET url`` answers 200."""
    return lambda: http_status(url, host=host) == 200


def epp_scraped(metrics_port: int, count: int, host: str = "127.0.0.1") -> Callable[[], bool]:
    """A check for :func:`wait_until`: the EPP's ``/status.json`` lists ``count`` endpoints or more,
    each scraped once (a profile leaves never-scraped endpoints out while others are healthy). True
    when the status page is off (404): nothing to wait for."""

    def check() -> bool:
        url = f"http://{host}:{metrics_port}/status.json"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                doc = json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code == 404
        except (OSError, ValueError):
            return False
        eps = [e for pool in doc.get("pools", []) for e in pool.get("endpoints", [])]
        return len(eps) >= count and all(e.get("metrics_age_s") is not None for e in eps)

    return check


def grpc_serving(port: int, service: str = "readiness", host: str = "127.0.0.1") -> bool:
    """True when the standard gRPC health service on ``port`` reports ``service`` SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def envoy_hosts_healthy(admin_port: int, cluster: str, count: int) -> bool:
    """True when Envoy's ``cluster`` has ``count`` hosts, all passing their health checks (admin
    ``/clusters``: each host's ``health_flags`` is ``healthy``)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters", timeout=2.0) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return False
    prefix = f"{cluster}::"
    flags = [
        line.rsplit("::", 1)[1]
        for line in text.splitlines()
        if line.startswith(prefix) and "::health_flags::" in line
    ]
    return len(flags) == count and all(f == "healthy" for f in flags)


class Interrupted(Exception):
    """Start-up was abandoned (Ctrl-C or SIGTERM)."""


def wait_until(
    what: str,
    check: Callable[[], bool],
    *,
    timeout: float = READY_TIMEOUT,
    interval: float = 0.1,
    children: Sequence[Child] = (),
    abort: Callable[[], bool] | None = None,
) -> None:
    """Poll ``check`` until true.

    Raises ChildExited if a watched child dies, Interrupted when ``abort()`` turns true and
    TimeoutError after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        for child in children:
            if not child.running():
                raise ChildExited(child)
        if abort is not None and abort():
            raise Interrupted(what)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
