"""``epp run``: a local stack — simulated vLLM servers, the EPP and a real Envoy in front of them.

The stack starts N ``epp sim`` servers (127.0.0.1:8000.. by default), writes their endpoints into a
file-discovery endpoints file, starts ``epp serve`` (plain-text ext_proc on 9002, health 9003,
metrics 9090) watching that file, renders an Envoy bootstrap with :mod:`epp.envoy_config` and starts
Envoy on 127.0.0.1:8081 (admin 19000). It waits until ``GET /v1/models`` through Envoy answers 200,
prints how to use it, and then supervises: Ctrl-C or SIGTERM stops every process it started. A
simulator that exits on its own is started again on its port (exponential backoff from 0.5 s, at
most ``--sim-max-restarts`` restarts in ``--sim-restart-window`` seconds; each restart is logged)
while the others keep serving. The EPP and Envoy are not restarted: they are what the stack is for,
so if one of them exits (or a simulator exceeds its restart budget) all others are stopped and
``epp run`` exits non-zero naming that child.

Each child runs in its own process group (so a stop reaches its own children too) and, on Linux,
gets SIGTERM if ``epp run`` itself dies (``PR_SET_PDEATHSIG``): no orphans even after ``kill -9``.

The helpers (:class:`Child`, :class:`Supervisor`, :class:`LocalStack`, the ``wait_*`` functions) are
also used by the integration tests and ``bench/cpu_per_request.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from epp.dev.envoy import bootstrap as envoy_config

DISCOVERY_PLUGIN_NAME = "epp-run-files"
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 5.0
SIM_MAX_RESTARTS = 5
SIM_RESTART_WINDOW = 60.0


# ------------------------------------------------------------------------------------- child processes


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


# Resolved once in the parent: the child only makes the call (no dlopen between fork and exec).
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel to SIGTERM this child when its parent dies (Linux only; best effort)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One child process, started in its own process group with stdout+stderr in ``log_path``."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    restart: RestartPolicy | None = None  # None: its exit is fatal to the supervisor
    restarts: deque[float] = field(default_factory=deque, repr=False)  # monotonic times of restarts
    restart_due: float | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> Child:
        """Start the process (stdin closed, output appended to the log file)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
            preexec_fn=_pdeathsig if _PRCTL is not None else None,
        )
        return self

    def respawn(self) -> Child:
        """Start the process again with the same command line (after it exited or was stopped)."""
        self.stop()
        return self.start()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``; idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_group(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._signal_group(signal.SIGKILL)
                    self.proc.wait(timeout)
            # Grandchildren left in the group (if any) go too.
            self._signal_group(signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL the process group at once (simulates a crash)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the child's output."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a child that exits is started again: after ``backoff`` x 2^(recent restarts) seconds (at
    most ``max_backoff``), and at most ``max_restarts`` times within ``window`` seconds."""

    max_restarts: int = SIM_MAX_RESTARTS
    window: float = SIM_RESTART_WINDOW
    backoff: float = 0.5
    max_backoff: float = 8.0

    def delay(self, recent: int) -> float:
        return float(min(self.backoff * 2**recent, self.max_backoff))


def _describe_status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Supervisor:
    """Starts children, restarts those with a :class:`RestartPolicy` when they exit, notices one
    whose exit is fatal, and stops them all (in reverse start order)."""

    def __init__(self, log_dir: Path, log: Callable[[str], None] = _stderr_line) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.log = log

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        restart: RestartPolicy | None = None,
    ) -> Child:
        child = Child(name, list(argv), self.log_dir / f"{name}.log", env=env, restart=restart).start()
        self.children.append(child)
        return child

    def exited(self) -> Child | None:
        """The first child that is no longer running, if any."""
        return next((c for c in self.children if not c.running()), None)

    def poll(self, now: float | None = None) -> Child | None:
        """One supervision step: schedule or perform due restarts; return a child whose exit is fatal.

        A child without a policy that exited, or one that already used ``max_restarts`` restarts
        within the policy's window, is fatal. Call it periodically (``epp run`` does, every 0.2 s).
        """
        now = time.monotonic() if now is None else now
        for child in self.children:
            policy = child.restart
            if child.running():
                continue
            if policy is None:
                return child
            if child.restart_due is None:
                while child.restarts and now - child.restarts[0] > policy.window:
                    child.restarts.popleft()
                status = _describe_status(child.returncode())
                if len(child.restarts) >= policy.max_restarts:
                    self.log(
                        f"{child.name} exited ({status}) after {len(child.restarts)} restarts within "
                        f"{policy.window:g} s; giving up"
                    )
                    return child
                delay = policy.delay(len(child.restarts))
                child.restart_due = now + delay
                self.log(
                    f"{child.name} exited ({status}); restarting it in {delay:g} s "
                    f"(restart {len(child.restarts) + 1} of at most {policy.max_restarts} "
                    f"in {policy.window:g} s)"
                )
            elif now >= child.restart_due:
                child.restart_due = None
                child.restarts.append(now)
                try:
                    child.respawn()
                except OSError as e:
                    self.log(f"{child.name} could not be restarted: {e}")
                    return child
                self.log(f"{child.name} restarted (pid {child.pid})")
        return None

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


class ChildExited(RuntimeError):
    """A child process exited while the stack was starting or running."""

    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with status {child.returncode()}")
        self.child = child


# --------------------------------------------------------------------------------------- readiness


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


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """Status of ``GET url``; None when the connection fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return None


def _http_ok(url: str) -> Callable[[], bool]:
    return lambda: http_status(url) == 200


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


# ----------------------------------------------------------------------------------- configuration


def endpoints_document(
    ports: Sequence[int], *, host: str = "127.0.0.1", prefix: str = "sim"
) -> dict[str, Any]:
    """The file-discovery endpoints document for sims on ``ports``."""
    return {
        "endpoints": [
            {"name": f"{prefix}-{i}", "namespace": "default", "address": host, "port": str(p), "labels": {}}
            for i, p in enumerate(ports)
        ]
    }


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by renaming a temporary file over it (watchers never see half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_endpoints(path: Path, ports: Sequence[int], *, host: str = "127.0.0.1") -> None:
    write_atomic(path, yaml.safe_dump(endpoints_document(ports, host=host), sort_keys=False))


def epp_config(endpoints_file: Path, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An EndpointPickerConfig with the file-discovery plugin for ``endpoints_file`` injected.

    ``base`` (e.g. a user's scheduling config) is kept; an existing ``file-discovery`` plugin is
    pointed at ``endpoints_file``, otherwise one is added, and ``dataLayer.discovery`` refers to it.
    """
    cfg: dict[str, Any] = dict(base or {})
    cfg.setdefault("apiVersion", "llm-d.ai/v1alpha1")
    cfg.setdefault("kind", "EndpointPickerConfig")
    plugins = [dict(p) for p in cfg.get("plugins") or []]
    discovery = next((p for p in plugins if p.get("type") == "file-discovery"), None)
    if discovery is None:
        discovery = {"name": DISCOVERY_PLUGIN_NAME, "type": "file-discovery"}
        plugins.insert(0, discovery)
    discovery["parameters"] = {
        **(discovery.get("parameters") or {}),
        "path": str(endpoints_file),
        "watchFile": True,
    }
    cfg["plugins"] = plugins
    data_layer = dict(cfg.get("dataLayer") or {})
    data_layer["discovery"] = {"pluginRef": discovery.get("name") or discovery["type"]}
    cfg["dataLayer"] = data_layer
    return cfg


def python_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "epp", *args]


def sim_argv(port: int, name: str, model: str = "demo", extra: Sequence[str] = ()) -> list[str]:
    return python_argv("sim", "--port", str(port), "--model", model, "--name", name, *extra)


def serve_argv(
    *,
    grpc_port: int,
    health_port: int,
    metrics_port: int,
    config_text: str,
    extra: Sequence[str] = (),
) -> list[str]:
    return python_argv(
        "serve",
        "--secure-serving=false",
        f"--grpc-port={grpc_port}",
        f"--grpc-health-port={health_port}",
        f"--metrics-port={metrics_port}",
        "--config-text",
        config_text,
        *extra,
    )


def envoy_argv(config_path: Path, *, log_level: str = "warning", concurrency: int | None = None) -> list[str]:
    # --disable-hot-restart: no shared-memory base id, so several Envoys can run side by side.
    argv = [envoy_config.envoy_binary(), "-c", str(config_path), "--log-level", log_level]
    argv += ["--disable-hot-restart"]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    return argv


# ------------------------------------------------------------------------------------------- stack


@dataclass
class StackOptions:
    """Everything ``epp run`` can vary."""

    sims: int = 3
    sim_base_port: int = 8000
    model: str = "demo"
    sim_args: list[str] = field(default_factory=list)
    port: int = 8081
    admin_port: int = 19000
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    body_mode: str = "FULL_DUPLEX_STREAMED"
    fail_open: bool = False
    config: dict[str, Any] | None = None
    epp_args: list[str] = field(default_factory=list)
    envoy_log_level: str = "warning"
    envoy_concurrency: int | None = None
    ready_timeout: float = READY_TIMEOUT
    sim_max_restarts: int = SIM_MAX_RESTARTS
    sim_restart_window: float = SIM_RESTART_WINDOW

    @property
    def sim_restart(self) -> RestartPolicy:
        return RestartPolicy(max_restarts=self.sim_max_restarts, window=self.sim_restart_window)

    @property
    def sim_ports(self) -> list[int]:
        return [self.sim_base_port + i for i in range(self.sims)]

    def all_ports(self) -> list[int]:
        return [
            *self.sim_ports,
            self.port,
            self.admin_port,
            self.grpc_port,
            self.health_port,
            self.metrics_port,
        ]


class LocalStack:
    """Sims + EPP + Envoy under one :class:`Supervisor`; ``start()`` returns once requests flow."""

    def __init__(self, opts: StackOptions, workdir: Path) -> None:
        self.opts = opts
        self.workdir = workdir
        self.supervisor = Supervisor(workdir / "logs")
        self.endpoints_file = workdir / "endpoints.yaml"
        self.envoy_file = workdir / "envoy.yaml"
        self.sims: list[Child] = []
        self.epp: Child | None = None
        self.envoy: Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.opts.port}"

    def start(self, abort: Callable[[], bool] | None = None) -> None:
        """Start every process and wait until requests flow; ``abort()`` true abandons the wait."""
        o = self.opts
        busy = [p for p in o.all_ports() if port_in_use(p)]
        if busy:
            raise RuntimeError(f"ports already in use: {', '.join(map(str, busy))}")
        for i, port in enumerate(o.sim_ports):
            argv = sim_argv(port, f"sim-{i}", o.model, o.sim_args)
            self.sims.append(self.supervisor.start(f"sim-{i}", argv, restart=o.sim_restart))
        write_endpoints(self.endpoints_file, o.sim_ports)
        config_text = yaml.safe_dump(epp_config(self.endpoints_file, o.config), sort_keys=False)
        self.epp = self.supervisor.start(
            "epp",
            serve_argv(
                grpc_port=o.grpc_port,
                health_port=o.health_port,
                metrics_port=o.metrics_port,
                config_text=config_text,
                extra=o.epp_args,
            ),
        )
        self.envoy_file.write_text(envoy_config.render(self.bootstrap()))
        self.envoy = self.supervisor.start(
            "envoy", envoy_argv(self.envoy_file, log_level=o.envoy_log_level, concurrency=o.envoy_concurrency)
        )
        self.wait_ready(abort)

    def bootstrap(self) -> dict[str, Any]:
        o = self.opts
        return envoy_config.envoy_bootstrap(
            listen_port=o.port,
            admin_port=o.admin_port,
            extproc_port=o.grpc_port,
            body_mode=o.body_mode,
            fail_open=o.fail_open,
            fallback_endpoints=[f"127.0.0.1:{p}" for p in o.sim_ports],
            extproc_health_port=o.health_port if o.fail_open else 0,
        )

    def wait_ready(self, abort: Callable[[], bool] | None = None) -> None:
        o = self.opts
        checks: list[tuple[str, Callable[[], bool]]] = [
            (c.name, _http_ok(f"http://127.0.0.1:{p}/health"))
            for c, p in zip(self.sims, o.sim_ports, strict=True)
        ]
        checks += [
            ("EPP readiness", lambda: grpc_serving(o.health_port)),
            ("Envoy", _http_ok(f"http://127.0.0.1:{o.admin_port}/ready")),
            ("GET /v1/models through Envoy", _http_ok(f"{self.url}/v1/models")),
        ]
        for what, check in checks:
            wait_until(what, check, timeout=o.ready_timeout, children=self.supervisor.children, abort=abort)

    def poll(self) -> Child | None:
        """Restart simulators that exited; the child whose exit ends the stack, if any."""
        return self.supervisor.poll()

    def stop(self) -> None:
        self.supervisor.stop_all()

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``epp run``."""
    add = parser.add_argument
    add("--sims", type=int, default=3, help="number of simulated vLLM servers (default 3)")
    add("--sim-base-port", type=int, default=8000, help="port of the first simulator (default 8000)")
    add("--model", default="demo", help="model name the simulators serve (default demo)")
    add("--sim-arg", action="append", default=[], metavar="ARG", help="extra flag for every simulator")
    add("--port", type=int, default=8081, help="Envoy listener port (default 8081)")
    add("--admin-port", type=int, default=19000, help="Envoy admin port (default 19000)")
    add("--grpc-port", type=int, default=9002, help="EPP ext_proc port (default 9002)")
    add("--grpc-health-port", type=int, default=9003, help="EPP gRPC health port (default 9003)")
    add("--metrics-port", type=int, default=9090, help="EPP metrics port (default 9090)")
    add(
        "--body-mode",
        choices=("FULL_DUPLEX_STREAMED", "BUFFERED"),
        default="FULL_DUPLEX_STREAMED",
        help="ext_proc request body mode (default FULL_DUPLEX_STREAMED)",
    )
    add("--fail-open", action="store_true", help="Envoy forwards to the simulators when the EPP is down")
    add(
        "--config-file",
        default=None,
        help="EndpointPickerConfig for the EPP (the file-discovery plugin is injected)",
    )
    add("--epp-arg", action="append", default=[], metavar="ARG", help="extra flag for epp serve")
    add("--envoy-log-level", default="warning", help="Envoy --log-level (default warning)")
    add(
        "--sim-max-restarts",
        type=_non_negative_int,
        default=SIM_MAX_RESTARTS,
        help=f"restarts of one simulator allowed within --sim-restart-window; one more exit stops the"
        f" stack; 0 never restarts (default {SIM_MAX_RESTARTS})",
    )
    add(
        "--sim-restart-window",
        type=_positive_float,
        default=SIM_RESTART_WINDOW,
        metavar="SECONDS",
        help=f"window of --sim-max-restarts (default {SIM_RESTART_WINDOW:g})",
    )
    add("--keep-workdir", action="store_true", help="keep the temporary directory (logs) on exit")
    parser.epilog = (
        "Supervision: a simulator that exits on its own is started again on its port after a backoff "
        "(0.5 s, doubling up to 8 s) while the others keep serving; each restart is logged on stderr. "
        "If one simulator exits more than --sim-max-restarts times within --sim-restart-window seconds, "
        "or if the EPP or Envoy exits (they are not restarted), every process is stopped and epp run "
        "exits with status 1. Ctrl-C or SIGTERM stops everything (status 0)."
    )


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number") from None
    if not value > 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def options_from_args(args: argparse.Namespace) -> StackOptions:
    config = None
    if args.config_file:
        try:
            loaded = yaml.safe_load(Path(args.config_file).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"error: --config-file {args.config_file}: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise SystemExit(f"error: --config-file {args.config_file}: not a YAML mapping")
        config = loaded
    return StackOptions(
        sims=args.sims,
        sim_base_port=args.sim_base_port,
        model=args.model,
        sim_args=list(args.sim_arg),
        port=args.port,
        admin_port=args.admin_port,
        grpc_port=args.grpc_port,
        health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        body_mode=args.body_mode,
        fail_open=args.fail_open,
        config=config,
        epp_args=list(args.epp_arg),
        envoy_log_level=args.envoy_log_level,
        sim_max_restarts=args.sim_max_restarts,
        sim_restart_window=args.sim_restart_window,
    )


class _Stop:
    """SIGINT/SIGTERM set a flag instead of raising inside the supervision loop."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal = signum
        self.event.set()


def _usage(stack: LocalStack) -> str:
    o = stack.opts
    sims = ", ".join(f"127.0.0.1:{p}" for p in o.sim_ports)
    return f"""
epp stack ready ({o.body_mode}, fail-{"open" if o.fail_open else "closed"})
  Envoy      {stack.url}  (admin http://127.0.0.1:{o.admin_port})
  EPP        ext_proc 127.0.0.1:{o.grpc_port}, health {o.health_port}, metrics http://127.0.0.1:{o.metrics_port}/metrics
  simulators {sims}  (model {o.model!r})
  endpoints  {stack.endpoints_file}  (edit it to add or remove endpoints)
  logs       {stack.supervisor.log_dir}

Try:
  curl -s {stack.url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{o.model}","messages":[{{"role":"user","content":"Hello!"}}]}}'
  curl -s -N {stack.url}/v1/completions -H 'content-type: application/json' \\
       -d '{{"model":"{o.model}","prompt":"Hello","stream":true}}'

A simulator that exits is restarted (at most {o.sim_max_restarts} times in {o.sim_restart_window:g} s); \
the EPP or Envoy exiting stops the stack.
Ctrl-C stops everything.
"""


def main(args: argparse.Namespace) -> int:
    """Run the stack until Ctrl-C/SIGTERM (exit 0) or until a child's exit is fatal (exit 1).

    Simulators that exit are restarted (see :meth:`Supervisor.poll`); the EPP or Envoy exiting, or a
    simulator exceeding its restart budget, is fatal.
    """
    opts = options_from_args(args)
    workdir = Path(tempfile.mkdtemp(prefix="epp-run-"))
    stack = LocalStack(opts, workdir)
    stop = _Stop()
    stop.install()
    failed = False
    try:
        try:
            print(f"starting {opts.sims} simulators, the EPP and Envoy (work dir {workdir}) ...", flush=True)
            stack.start(abort=stop.event.is_set)
        except Interrupted:
            return 0
        except ChildExited as e:
            failed = True
            return _report_exit(e.child)
        except (RuntimeError, TimeoutError, FileNotFoundError) as e:
            failed = True
            print(f"error: {e}", file=sys.stderr)
            _print_tails(stack)
            return 1
        print(_usage(stack), flush=True)
        while not stop.event.wait(0.2):
            child = stack.poll()
            if child is not None:
                failed = True
                return _report_exit(child)
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()
        stop.restore()
        if failed or args.keep_workdir:
            print(f"logs kept in {stack.supervisor.log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _report_exit(child: Child) -> int:
    print(f"error: {child.name} exited unexpectedly with status {child.returncode()}", file=sys.stderr)
    tail = child.tail()
    if tail:
        print(f"--- last lines of {child.log_path} ---\n{tail}", file=sys.stderr)
    return 1


def _print_tails(stack: LocalStack) -> None:
    for child in stack.supervisor.children:
        tail = child.tail(15)
        if tail:
            print(f"--- {child.name} ({child.log_path}) ---\n{tail}", file=sys.stderr)
