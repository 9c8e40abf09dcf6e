"""The local stack: simulated vLLM servers, the EPP and a real Envoy on 127.0.0.1.

:class:`Stack` starts the pieces one by one (what each needs is written into its work directory)
under one :class:`Supervisor`; :class:`LocalStack` is ``epp run``'s composition of them: N sims on
consecutive ports, ``epp serve`` watching a file-discovery endpoints file and Envoy in front; with
``replicas`` above 1, that many ``epp serve`` sharing their routing state through a private
``redis-server`` and Envoy's ext_proc cluster spread over them. The benchmarks and the integration
tests use the same two classes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from epp.dev.envoy.bootstrap import DEFAULT_BODY_MODE, EXT_PROC_CLUSTER, envoy_bootstrap, render
from epp.dev.envoy.exchange import RESPONSE_BODY_MODE, ResponseModes, modes_for_document
from epp.dev.stack import engines
from epp.dev.stack.commands import envoy_argv, epp_socket, serve_argv, sim_argv
from epp.dev.stack.files import epp_config, given_endpoints, with_redis_syncer, write_atomic, write_endpoints
from epp.dev.stack.probes import (
    READY_TIMEOUT,
    envoy_hosts_healthy,
    free_port,
    free_port_block,
    free_ports,
    grpc_serving,
    http_ok,
    port_in_use,
    wait_until,
)
from epp.dev.stack.redis_server import missing_message, redis_argv, redis_pong, redis_server_binary
from epp.dev.stack.replicas import Replica, spread_ext_proc
from epp.dev.stack.supervisor import SIM_MAX_RESTARTS, SIM_RESTART_WINDOW, Child, RestartPolicy, Supervisor
from epp.framework.endpoint import KV_EVENTS_PORT_LABEL, KV_EVENTS_REPLAY_PORT_LABEL
from epp.framework.wire import POOL_LABEL


def kv_events_sim_args(pub: int, replay: int) -> list[str]:
    """``epp sim`` flags publishing KV events on port ``pub`` with the replay socket on ``replay``."""
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return ["--kv-events-config", json.dumps(kv)]


def kv_events_labels(pub: int, replay: int) -> dict[str, str]:
    """The endpoint labels that tell the EPP those ports (several sims share one host)."""
    return {KV_EVENTS_PORT_LABEL: str(pub), KV_EVENTS_REPLAY_PORT_LABEL: str(replay)}


class Stack:
    """Simulators, EPPs and Envoys on 127.0.0.1 under one :class:`Supervisor`.

    The ``start_*`` methods start one process and return at once; :meth:`wait` and the ``wait_*``
    methods poll a readiness probe, failing as soon as a watched process exits. :meth:`stop` (or the
    end of a ``with`` block) stops every process, in reverse start order.
    """

    def __init__(
        self, workdir: Path, *, log_dir: Path | None = None, ready_timeout: float = READY_TIMEOUT
    ) -> None:
        self.workdir = workdir
        self.ready_timeout = ready_timeout
        self.supervisor = Supervisor(workdir / "logs" if log_dir is None else log_dir)

    @property
    def children(self) -> list[Child]:
        return self.supervisor.children

    # ------------------------------------------------------------------------------------ processes

    def start_sim(
        self,
        name: str,
        port: int,
        *,
        model: str = "demo",
        args: Sequence[str] = (),
        restart: RestartPolicy | None = None,
    ) -> Child:
        """``epp sim`` on ``port`` serving ``model``; ``restart`` makes the supervisor restart it."""
        return self.supervisor.start(name, sim_argv(port, name, model, args), restart=restart)

    def start_epp(
        self,
        name: str,
        *,
        grpc_port: int,
        health_port: int,
        metrics_port: int,
        config: Mapping[str, Any],
        extra: Sequence[str] = (),
        config_file: Path | None = None,
        restart: RestartPolicy | None = None,
    ) -> Child:
        """``epp serve`` (plain-text ext_proc) with the EndpointPickerConfig document ``config``
        (written to ``config_file`` and passed as ``--config-file`` when that is given); ``restart``
        makes the supervisor restart it."""
        config_text = yaml.safe_dump(dict(config), sort_keys=False)
        if config_file is not None:
            config_file.write_text(config_text)
        argv = serve_argv(
            grpc_port=grpc_port,
            health_port=health_port,
            metrics_port=metrics_port,
            config_text=config_text,
            extra=extra,
            config_file=str(config_file) if config_file is not None else "",
        )
        return self.supervisor.start(name, argv, restart=restart)

    def start_envoy(
        self,
        name: str,
        bootstrap: Mapping[str, Any],
        *,
        log_level: str = "warning",
        concurrency: int | None = None,
    ) -> Child:
        """Envoy with ``bootstrap`` (written to ``workdir/<name>.yaml``)."""
        path = self.workdir / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(dict(bootstrap)))
        return self.supervisor.start(name, envoy_argv(path, log_level=log_level, concurrency=concurrency))

    # ------------------------------------------------------------------------------------ readiness

    def wait(
        self,
        what: str,
        check: Callable[[], bool],
        *,
        children: Sequence[Child] | None = None,
        abort: Callable[[], bool] | None = None,
    ) -> None:
        """Poll ``check`` for at most ``ready_timeout`` s (see :func:`wait_until`); ``children``
        defaults to every process of the stack."""
        watched = self.children if children is None else children
        wait_until(what, check, timeout=self.ready_timeout, children=watched, abort=abort)

    def wait_sim(self, child: Child, url: str, *, what: str = "") -> None:
        """Until the simulator at ``url`` answers ``GET /health`` with 200."""
        self.wait(what or f"{child.name} /health", http_ok(f"{url}/health"), children=[child])

    def wait_epp(self, child: Child, health_port: int, *, service: str = "readiness", what: str = "") -> None:
        """Until the EPP's gRPC health service reports ``service`` SERVING."""
        self.wait(
            what or f"{child.name} {service} (gRPC health)",
            lambda: grpc_serving(health_port, service),
            children=[child],
        )

    def wait_envoy(self, child: Child, admin_port: int, *, what: str = "") -> None:
        """Until Envoy's admin ``/ready`` answers 200."""
        self.wait(
            what or f"{child.name} admin /ready",
            http_ok(f"http://127.0.0.1:{admin_port}/ready"),
            children=[child],
        )

    def stop(self) -> None:
        self.supervisor.stop_all()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Replica i of ``epp run --replicas`` listens on each of the first replica's ports + i x this step.
REPLICA_PORT_STEP = 100


@dataclass(frozen=True, slots=True)
class EppPorts:
    """One EPP replica's ports: ext_proc (and its Unix socket, in ``socket_dir`` if that is short
    enough, see :func:`epp_socket`), gRPC health, metrics."""

    grpc: int
    health: int
    metrics: int
    socket_dir: str = ""

    @property
    def socket(self) -> str:
        return epp_socket(self.grpc, self.socket_dir)


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
    body_mode: str = DEFAULT_BODY_MODE
    fail_open: bool = False
    config: dict[str, Any] | None = None
    epp_args: list[str] = field(default_factory=list)
    envoy_log_level: str = "warning"
    envoy_concurrency: int | None = None
    ready_timeout: float = READY_TIMEOUT
    sim_max_restarts: int = SIM_MAX_RESTARTS
    sim_restart_window: float = SIM_RESTART_WINDOW
    kv_events_base_port: int = 0  # > 0: sim i publishes KV events on this + 2i, replay on + 2i + 1
    response_phases: bool = False  # Envoy sends the response headers and body (response metrics)
    replicas: int = 1  # > 1: that many EPPs sharing state through a private redis-server
    replica_ports: list[EppPorts] | None = None  # None: derived from grpc/health/metrics_port
    redis_port: int = 0  # replicas > 1: the private redis-server's port (0: a free one)
    share_state: bool = True  # replicas > 1: False runs them without Redis, each learning alone
    socket_dir: str = ""  # the EPPs' Unix sockets' directory ("": LocalStack's work directory)
    engine: str = "sim"  # "vllm": real vLLM engines from `make engines` in place of the simulators
    endpoints: list[str] = field(default_factory=list)  # host:port of engines already running (no sims)
    pools: int = 1  # > 1: the sims split round robin into pools pool-1..N, a virtual host (Host) each

    @classmethod
    def on_free_ports(
        cls, sims: int, *, kv_events: bool = False, replicas: int = 1, **options: Any
    ) -> StackOptions:
        """Options with every port (Envoy, admin, every replica's gRPC, health and metrics, the sims',
        with ``kv_events`` the sims' KV-events ports, Redis) a free one."""
        port, admin, *epps = free_ports(2 + 3 * replicas + int(replicas > 1))  # + Redis's: all distinct
        grpc, health, metrics = epps[:3]
        base = free_port_block(3 * sims if kv_events else sims)  # the sims' ports, then the KV-events ones
        if kv_events:
            options["kv_events_base_port"] = base + sims
        if replicas > 1:
            options["replica_ports"] = [
                EppPorts(epps[3 * i], epps[3 * i + 1], epps[3 * i + 2]) for i in range(replicas)
            ]
            options.setdefault("redis_port", epps[3 * replicas])
        return cls(
            replicas=replicas,
            sims=sims,
            sim_base_port=base,
            port=port,
            admin_port=admin,
            grpc_port=grpc,
            health_port=health,
            metrics_port=metrics,
            **options,
        )

    @property
    def sim_restart(self) -> RestartPolicy:
        return RestartPolicy(max_restarts=self.sim_max_restarts, window=self.sim_restart_window)

    @property
    def sim_ports(self) -> list[int]:
        return [self.sim_base_port + i for i in range(self.sims)]

    @property
    def upstreams(self) -> list[str]:
        """``host:port`` of every engine the EPP routes to (started by the stack or given)."""
        return list(self.endpoints) or [f"127.0.0.1:{p}" for p in self.sim_ports]

    def kv_events_ports(self, sim: int) -> tuple[int, int]:
        """(PUB port, replay port) of sim ``sim``'s KV events (only when ``kv_events_base_port``)."""
        base = self.kv_events_base_port + 2 * sim
        return base, base + 1

    def sim_argv_extra(self, sim: int) -> list[str]:
        """Sim ``sim``'s flags: ``sim_args`` plus its KV-events publisher when enabled."""
        if not self.kv_events_base_port:
            return list(self.sim_args)
        return [*self.sim_args, *kv_events_sim_args(*self.kv_events_ports(sim))]

    def endpoint_labels(self) -> dict[str, dict[str, str]]:
        """Per endpoint name, the labels announcing its KV-events ports to the EPP, and its pool."""
        labels: dict[str, dict[str, str]] = {f"sim-{i}": {} for i in range(self.sims)}
        if self.kv_events_base_port:
            for i in range(self.sims):
                labels[f"sim-{i}"].update(kv_events_labels(*self.kv_events_ports(i)))
        if self.pools > 1:
            for i in range(self.sims):
                labels[f"sim-{i}"][POOL_LABEL] = self.pool_names[i % self.pools]
        return {name: value for name, value in labels.items() if value}

    @property
    def pool_names(self) -> list[str]:
        """The pools of ``--pools N`` (none with one pool)."""
        return [f"pool-{i + 1}" for i in range(self.pools)] if self.pools > 1 else []

    def epps(self) -> list[EppPorts]:
        """Every EPP replica's ports: ``replica_ports``, else replica i on the first one's + i x 100."""
        if self.replica_ports is not None:
            return [replace(e, socket_dir=self.socket_dir) for e in self.replica_ports]
        step = REPLICA_PORT_STEP
        return [
            EppPorts(
                self.grpc_port + step * i,
                self.health_port + step * i,
                self.metrics_port + step * i,
                self.socket_dir,
            )
            for i in range(self.replicas)
        ]

    def all_ports(self) -> list[int]:
        return [port for port, _ in self.port_flags()]

    def port_flags(self) -> list[tuple[int, str]]:
        """Every port the stack listens on, with the ``epp run`` flag that moves it."""
        kv = [(p, "--kv-events") for i in range(self.sims) for p in self.kv_events_ports(i)]
        epps: list[tuple[int, str]] = []
        for i, e in enumerate(self.epps()):
            which = f", replica {i}" if i else ""
            epps += [
                (e.grpc, f"--grpc-port{which}"),
                (e.health, f"--grpc-health-port{which}"),
                (e.metrics, f"--metrics-port{which}"),
            ]
        redis = [(self.redis_port, "--redis-port")] if self.shares_state and self.redis_port else []
        return [
            *(kv if self.kv_events_base_port else []),
            *((p, "--sim-base-port") for p in self.sim_ports),
            (self.port, "--port"),
            (self.admin_port, "--admin-port"),
            *epps,
            *redis,
        ]

    @property
    def shares_state(self) -> bool:
        """Whether the replicas share their routing state (through the stack's Redis)."""
        return self.replicas > 1 and self.share_state

    def check(self) -> None:
        """Refuse what cannot run: no replica, a replica count that does not match ``replica_ports``,
        one port used twice, or no Unix socket path short enough (see :func:`epp_socket`)."""
        if self.replicas < 1:
            raise ValueError(f"replicas: must be at least 1, got {self.replicas}")
        if self.pools > 1 and self.sims < self.pools:
            raise ValueError(f"pools: {self.pools} pools need at least as many --sims, got {self.sims}")
        if self.replica_ports is not None and len(self.replica_ports) != self.replicas:
            raise ValueError(f"replica_ports: {len(self.replica_ports)} for {self.replicas} replicas")
        twice = sorted(p for p, n in Counter(self.all_ports()).items() if n > 1)
        if twice:
            raise ValueError(f"ports used twice: {', '.join(map(str, twice))}")
        if any(not 0 < p < 65536 for p in self.all_ports()):
            raise ValueError("a port beyond 65535 (fewer --replicas, or lower base ports)")
        for e in self.epps():
            epp_socket(e.grpc, e.socket_dir)  # ValueError when no socket path fits

    def busy_ports(self) -> str:
        """The ports another process holds, each group with the flag that moves it ("" if none)."""
        by_flag: dict[str, list[int]] = {}
        for port, flag in self.port_flags():
            if port_in_use(port):
                by_flag.setdefault(flag, []).append(port)
        return ", ".join(f"{', '.join(map(str, ports))} ({flag})" for flag, ports in by_flag.items())


class LocalStack(Stack):
    """``epp run``'s stack: sims + EPP(s) + Envoy; ``start()`` returns once requests flow through Envoy.

    Simulators restart under ``opts.sim_restart``. One EPP and Envoy are not restarted. With
    ``opts.replicas`` above 1 a private ``redis-server`` (on ``opts.redis_port``, else a free port)
    starts first, every replica gets the ``redis-syncer`` pointed at it (merged into ``opts.config``),
    Envoy's ext_proc cluster spreads streams over the replicas' Unix sockets with gRPC health checks,
    and a replica or Redis that exits is restarted like a simulator (Redis empty: the replicas refill it).
    """

    def __init__(self, opts: StackOptions, workdir: Path) -> None:
        """``opts`` without a ``socket_dir``: the EPPs' Unix sockets go into ``workdir`` (removed
        with it; a stack killed outright leaves none in the temporary directory)."""
        super().__init__(workdir, ready_timeout=opts.ready_timeout)
        self.opts = opts if opts.socket_dir else replace(opts, socket_dir=str(workdir))
        self.endpoints_file = workdir / "endpoints.yaml"
        self.envoy_file = workdir / "envoy.yaml"
        self.config_file = workdir / "epp-config.yaml"  # the EPPs watch it: edits apply without a restart
        self.sims: list[Child] = []
        self.epps: list[Child] = []
        self.epp: Child | None = None  # the first replica
        self.envoy: Child | None = None
        self.redis: Child | None = None
        self.redis_port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.opts.port}"

    @property
    def redis_address(self) -> str:
        return f"127.0.0.1:{self.redis_port}"

    def start(self, abort: Callable[[], bool] | None = None) -> None:
        """Start every process and wait until requests flow; ``abort()`` true abandons the wait.

        Raises FileNotFoundError (naming the Debian package) when replicas need a ``redis-server``
        that is not on PATH, ValueError for options that cannot run (see :meth:`StackOptions.check`).
        """
        o = self.opts
        o.check()
        redis_binary = ""
        if o.shares_state:
            redis_binary = redis_server_binary() or ""
            if not redis_binary:
                raise FileNotFoundError(missing_message(f"--replicas {o.replicas}"))
        busy = o.busy_ports()
        if busy:
            raise RuntimeError(f"ports already in use: {busy}; move them with those epp run flags")
        if redis_binary:
            self.start_redis(redis_binary)
        for i, port in enumerate(o.sim_ports):
            if o.engine == "vllm":
                self.sims.append(self.start_vllm(i, port))
                continue
            self.sims.append(
                self.start_sim(
                    f"sim-{i}", port, model=o.model, args=o.sim_argv_extra(i), restart=o.sim_restart
                )
            )
        if o.endpoints:
            write_atomic(self.endpoints_file, yaml.safe_dump(given_endpoints(o.endpoints), sort_keys=False))
        else:
            write_endpoints(self.endpoints_file, o.sim_ports, labels=o.endpoint_labels())
        config = self.epp_document()
        restart = o.sim_restart if o.replicas > 1 else None
        for i, ports in enumerate(o.epps()):
            self.epps.append(
                self.start_epp(
                    "epp" if o.replicas == 1 else f"epp-{i}",
                    grpc_port=ports.grpc,
                    health_port=ports.health,
                    metrics_port=ports.metrics,
                    config=config,
                    extra=["--grpc-socket", ports.socket, "--watch-config-file", *o.epp_args],
                    config_file=self.config_file,
                    restart=restart,
                )
            )
        self.epp = self.epps[0]
        self.envoy = self.start_envoy(
            "envoy", self.bootstrap(), log_level=o.envoy_log_level, concurrency=o.envoy_concurrency
        )
        self.wait_ready(abort)

    def start_vllm(self, i: int, port: int) -> Child:
        """Engine ``i``: vLLM from ``make engines`` (the tiny model) on ``port``, its KV events on the
        stack's KV-events ports, restarted like a simulator."""
        o = self.opts
        pub, replay = o.kv_events_ports(i) if o.kv_events_base_port else (0, 0)
        argv = engines.vllm_argv(port, kv_pub=pub, kv_replay=replay, served_name=o.model, extra=o.sim_args)
        return self.supervisor.start(f"vllm-{i}", argv, env=engines.vllm_env(), restart=o.sim_restart)

    def start_redis(self, binary: str) -> Child:
        """The replicas' private ``redis-server`` on 127.0.0.1 (restarted, empty, when it exits)."""
        self.redis_port = self.opts.redis_port or free_port()
        argv = redis_argv(binary, self.redis_port, self.workdir)
        self.redis = self.supervisor.start("redis", argv, restart=self.opts.sim_restart)
        self.wait(f"redis-server on {self.redis_address}", lambda: redis_pong(self.redis_port))
        return self.redis

    def epp_document(self) -> dict[str, Any]:
        """Every replica's EndpointPickerConfig: ``opts.config`` with the endpoints file and, with
        several replicas, the ``redis-syncer`` at the stack's Redis."""
        o = self.opts
        config = o.config
        if o.shares_state:
            config = with_redis_syncer(config, self.redis_address)
        return epp_config(self.endpoints_file, config)

    def bootstrap(self) -> dict[str, Any]:
        """Envoy's bootstrap; the response phases follow the EPP config's plugins (``exchange``)."""
        o = self.opts
        modes = modes_for_document(epp_config(self.endpoints_file, o.config))
        if o.response_phases:
            modes = ResponseModes("SEND", RESPONSE_BODY_MODE)
        first = o.epps()[0]
        bootstrap = envoy_bootstrap(
            response_header_mode=modes.header,
            response_body_mode=modes.body,
            listen_port=o.port,
            admin_port=o.admin_port,
            extproc_port=first.grpc,
            extproc_socket=first.socket,  # Envoy and the EPP side by side: a Unix socket
            body_mode=o.body_mode,
            fail_open=o.fail_open,
            fallback_endpoints=o.upstreams,
            extproc_health_port=first.health if o.fail_open else 0,
            pools=o.pool_names,
        )
        if o.replicas == 1:
            return bootstrap
        replicas = [Replica("127.0.0.1", e.grpc, e.health, socket=e.socket) for e in o.epps()]
        # Round robin: a stream costs its replica CPU only while it is routed, not while it is open
        # (least-request, Envoy's choice among equally idle hosts, sent sequential requests to one).
        return spread_ext_proc(bootstrap, replicas)

    def wait_ready(self, abort: Callable[[], bool] | None = None) -> None:
        o = self.opts
        checks: list[tuple[str, Callable[[], bool]]] = [
            (c.name, http_ok(f"http://127.0.0.1:{p}/health"))
            for c, p in zip(self.sims, o.sim_ports, strict=True)
        ]
        checks += [(f"engine {a}", http_ok(f"http://{a}/health")) for a in o.endpoints]
        for child, ports in zip(self.epps, o.epps(), strict=True):
            name = "EPP" if o.replicas == 1 else child.name
            checks.append((f"{name} readiness", lambda h=ports.health: grpc_serving(h)))  # type: ignore[misc]
        checks.append(("Envoy", http_ok(f"http://127.0.0.1:{o.admin_port}/ready")))
        if o.replicas > 1:
            checks.append(
                (
                    f"every replica healthy in Envoy's {EXT_PROC_CLUSTER} cluster",
                    lambda: envoy_hosts_healthy(o.admin_port, EXT_PROC_CLUSTER, o.replicas),
                )
            )
        for pool in o.pool_names:  # each pool's virtual host
            checks.append(
                (f"GET /v1/models through Envoy for {pool}", http_ok(f"{self.url}/v1/models", host=pool))
            )
        if not o.pool_names:
            checks.append(("GET /v1/models through Envoy", http_ok(f"{self.url}/v1/models")))
        for what, check in checks:
            self.wait(what, check, abort=abort)

    def poll(self) -> Child | None:
        """Restart simulators (and replicas, Redis) that exited; the child whose exit ends the stack."""
        return self.supervisor.poll()

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self
