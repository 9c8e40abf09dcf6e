"""The ``epp`` command: ``serve`` (the EPP), ``sim`` (a simulated vLLM server), ``run`` (a local
stack: Envoy + EPP + simulators), ``check-config`` (validate a config, print the effective one),
``plugins`` (the registered plugin types), ``certs`` (a CA and the key pairs the Kubernetes
manifests mount) and ``envoy-config`` (an Envoy bootstrap).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from epp import __version__, observe
from epp.flags import (
    add_bool,
    add_reference_flags,
    check_reference_flags,
    parse_duration,
    parse_feature_gates,
    parse_port,
)


def run_async(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main`` on uvloop when it is installed (cheaper per request), else on asyncio."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def _config_watch(args: argparse.Namespace, endpoints: Callable[[], Any]) -> tuple[str, Any] | None:
    """``--watch-config-file``: the file, and how a changed text becomes a candidate config."""
    if not args.watch_config_file:
        return None
    if not args.config_file:
        raise SystemExit("error: --watch-config-file needs --config-file")
    from epp.config import load_config

    path = args.config_file

    def load(text: str) -> Any:
        return load_config(text, source=path, endpoints=endpoints, **_config_options(args))

    return path, load


def _config_text(args: argparse.Namespace) -> tuple[str | None, str]:
    if args.config_file and args.config_text:
        raise SystemExit(
            'error: both the "configText" and "configFile" flags can not be set at the same time'
        )
    if args.config_file:
        try:
            return Path(args.config_file).read_text(), args.config_file
        except OSError as e:
            raise SystemExit(f"error: --config-file: {e}") from None
    return args.config_text, "--config-text"


def _load(
    text: str | None,
    source: str,
    endpoints: Callable[[], Any] | None = None,
    *,
    allow_experimental: bool = False,
    log_warnings: bool = False,
    feature_gates: Mapping[str, bool] | None = None,
    compat_version: str = "",
) -> Any:
    """Load a config or exit 2, listing every error; its warnings go to stderr (as log events with
    ``log_warnings``)."""
    from epp.config import ConfigError, ConfigErrors, load_config

    try:
        cfg = load_config(
            text,
            source=source,
            endpoints=endpoints,
            allow_experimental=allow_experimental,
            feature_gates=feature_gates,
            compat_version=compat_version,
        )
    except ConfigErrors as e:
        lines = "".join(f"\n  {error}" for error in e.errors)
        print(f"error: invalid configuration {source}: {len(e.errors)} errors:{lines}", file=sys.stderr)
        raise SystemExit(2) from None
    except ConfigError as e:
        print(f"error: invalid configuration {source}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for warning in cfg.warnings:
        if log_warnings:
            import structlog

            structlog.get_logger("epp.config").warning("configuration warning", source=source, detail=warning)
        else:
            print(f"warning: {warning}", file=sys.stderr)
    return cfg


_DESCRIPTION = (
    "epp, an Endpoint Picker for LLM inference behind Envoy. Commands: serve (the EPP), sim (a "
    "simulated vLLM server), run (a local stack: Envoy + EPP + simulators), check-config (validate a "
    "config, print the effective one), plugins (the registered plugin types), certs (a CA and the key "
    "pairs the Kubernetes manifests mount), envoy-config (an Envoy bootstrap for the EPP). "
    "`epp COMMAND --help` lists a command's flags."
)


# --- serve ------------------------------------------------------------------------------------


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the Endpoint Picker (ext_proc gRPC server)", usage="%(prog)s [options]"
    )
    ports = p.add_argument_group("ports and shutdown")
    tls = p.add_argument_group("TLS of the ext_proc port")
    conf = p.add_argument_group("configuration")
    ports.add_argument("--grpc-port", type=parse_port, default=9002, help="ext_proc gRPC port (default 9002)")
    ports.add_argument(
        "--grpc-health-port", type=parse_port, default=9003, help="gRPC health port (default 9003)"
    )
    ports.add_argument(
        "--grpc-socket",
        default="",
        metavar="PATH",
        help="also serve ext_proc on this Unix socket (a sidecar Envoy in the same pod: cheaper than TCP)",
    )
    ports.add_argument(
        "--metrics-port", type=parse_port, default=9090, help="Prometheus metrics port (default 9090)"
    )
    ports.add_argument("--bind-address", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    conf.add_argument(
        "--objectives-file",
        default="",
        metavar="PATH",
        help="request priorities without Kubernetes: YAML 'objectives: [{name: critical, priority: 10}]', "
        "named per request by the x-llm-d-inference-objective header (read at start)",
    )
    add_bool(
        tls,
        "--secure-serving",
        True,
        "serve ext_proc over TLS (default true; self-signed unless --cert-path)",
    )
    tls.add_argument("--cert-path", default=None, help="directory holding tls.crt and tls.key")
    add_bool(
        tls,
        "--enable-cert-reload",
        False,
        "serve renewed certificates from --cert-path (and --ha-replication-cert-path) without a restart",
    )
    tls.add_argument(
        "--grpc-client-ca-file",
        default=None,
        help="PEM CA bundle: ext_proc requires a client certificate it signed (mTLS; needs --cert-path)",
    )
    add_bool(ports, "--health-checking", False, "also serve gRPC health on the ext_proc port")
    conf.add_argument("--config-file", default=None, help="EndpointPickerConfig YAML file")
    conf.add_argument("--config-text", default=None, help="EndpointPickerConfig YAML text")
    add_bool(
        conf,
        "--watch-config-file",
        False,
        "apply changes of --config-file without a restart (profiles, scheduling plugin parameters, "
        "flow-control bands); an invalid change keeps the running config and is logged",
    )
    _add_allow_experimental(conf)
    k = p.add_argument_group("Kubernetes discovery (one of --pool-name, --endpoint-selector)")
    k.add_argument(
        "--pool-name",
        default="",
        action=_PoolNames,
        help="InferencePool to serve (with file discovery: the pool's name only); repeat it to serve "
        "several pools from one EPP",
    )
    k.add_argument(
        "--pool-selector",
        default="",
        help="serve every InferencePool of --pool-namespace matching this label selector k=v,... "
        "(pools that appear or go are followed)",
    )
    k.add_argument(
        "--pool-namespace",
        default=os.environ.get("NAMESPACE") or "default",
        help="namespace of the pool and its pods (default: env NAMESPACE, else default)",
    )
    k.add_argument("--pool-group", default="inference.networking.k8s.io", help="InferencePool API group")
    k.add_argument(
        "--endpoint-selector", default="", help="standalone mode: pods matching this label selector k=v,..."
    )
    k.add_argument(
        "--endpoint-target-ports", default="", help="standalone mode: 1 to 8 ports per pod, comma-separated"
    )
    k.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster service account)")
    k.add_argument(
        "--model-server-metrics-port",
        type=parse_port,
        default=None,
        help="deprecated: scrape metrics from this pod port (only when the pool has one target port)",
    )
    k = p.add_argument_group("high availability (several replicas; Kubernetes discovery)")
    add_bool(k, "--ha-enable-leader-election", False, "readiness only on the replica holding the Lease")
    k.add_argument(
        "--ha-lease-duration", type=parse_duration, default=15.0, help="lease duration (default 15s)"
    )
    k.add_argument(
        "--ha-renew-deadline", type=parse_duration, default=10.0, help="renew deadline (default 10s)"
    )
    k.add_argument("--ha-retry-period", type=parse_duration, default=2.0, help="retry period (default 2s)")
    k.add_argument(
        "--ha-lease-name",
        default="",
        help="Lease to elect on (default epp-<namespace>-<pool>.gateway-api-inference-extension.sigs.k8s.io)",
    )
    k.add_argument(
        "--ha-replication-port",
        type=parse_port,
        default=9004,
        help="deprecated (use a cross-replica syncer, redis-syncer): port of the leader's state "
        "stream to the standbys (mutual TLS; default 9004)",
    )
    k.add_argument(
        "--ha-replication-cert-path",
        default=None,
        help="directory with tls.crt, tls.key and ca.crt: this replica's certificate (naming "
        "epp-replica) and the CA its peers' must be signed by; without it standbys are not warmed",
    )
    k.add_argument(
        "--ha-advertise-address",
        default=None,
        help="host:port where standbys reach this replica's state stream (default: $POD_IP, else the "
        "host's address, and --ha-replication-port)",
    )
    data = p.add_argument_group("data layer (endpoint metrics)")
    req = p.add_argument_group("requests and routing")
    mets = p.add_argument_group("metrics")
    data.add_argument(
        "--refresh-metrics-interval", type=parse_duration, default=0.05, help="scrape period (default 50ms)"
    )
    data.add_argument(
        "--refresh-prometheus-metrics-interval",
        type=parse_duration,
        default=5.0,
        help="how often the pool gauges (average queue size, KV-cache use, ...) are recomputed (default 5s)",
    )
    data.add_argument(
        "--metrics-staleness-threshold",
        type=_positive_duration,
        default=2.0,
        help="scraped metrics older than this (or never scraped) are unknown: metric-based scorers "
        "score the endpoint neutrally and the pool gauges leave it out (default 2s)",
    )
    data.add_argument(
        "--metrics-scrape-timeout",
        type=_positive_duration,
        default=None,
        help="how long one scrape of an endpoint's metrics may take (default: the staleness threshold "
        "less one refresh interval, at least 1s: 1.95s with the defaults)",
    )
    add_bool(req, "--disable-endpoint-subset-filter", False, "ignore Envoy's subset hint")
    add_bool(
        req,
        "--allow-model-rewrite-header",
        True,
        "honour a client's x-llm-d-model-name-rewrite (or x-gateway-model-name-rewrite) header: the "
        "request goes to that model, the response names the requested one (default true, as the "
        "reference); false: ignore it. InferenceModelRewrite rules win either way",
    )
    req.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=10 << 20,
        help="larger request bodies are answered 413 (default 10 MiB; the reference has no limit)",
    )
    req.add_argument(
        "--max-buffered-request-body-bytes",
        type=int,
        default=256 << 20,
        help="partial request bodies held across all streams; a chunk over it is answered 503 "
        "(default 256 MiB; 0: no limit)",
    )
    req.add_argument(
        "--request-idle-timeout",
        type=parse_duration,
        default=60.0,
        help="end an ext_proc stream whose request is incomplete and silent this long with gRPC "
        "DEADLINE_EXCEEDED (default 60s; 0: never; the response phase is never timed)",
    )
    add_bool(req, "--debug-response-header", True, "add x-went-into-resp-headers: true (reference behaviour)")
    ports.add_argument(
        "--grace-period", type=parse_duration, default=5.0, help="drain time on shutdown (default 5s)"
    )
    ports.add_argument(
        "--drain-delay",
        type=parse_duration,
        default=1.0,
        help="on shutdown, keep serving this long after readiness turns NOT_SERVING (default 1s)",
    )
    add_bool(
        req,
        "--skip-unused-response-phases",
        False,
        "BUFFERED request bodies: when no loaded plugin reads the response and the request is not "
        "model-rewritten, the request-headers reply turns the response headers and body off for that "
        "request (ext_proc mode_override; the filter needs allow_mode_override); response metrics "
        "(TTFT, sizes, usage) then go too (default false)",
    )
    add_bool(
        req,
        "--emit-endpoint-scores",
        False,
        "put the picked endpoints' scheduler scores in the routing reply's envoy.lb metadata under "
        "x-gateway-destination-endpoint-scores (default false)",
    )
    add_bool(
        mets,
        "--emit-deprecated-metrics",
        True,
        "also expose the deprecated metric names (inference_objective_*, inference_extension_*, ...) "
        "beside the llm_d_epp_* ones, for dashboards built on them (default true)",
    )
    add_bool(
        mets,
        "--enable-grpc-stream-metrics",
        False,
        "expose llm_d_epp_extproc_stream_duration_seconds and llm_d_epp_extproc_streams_total{code} "
        "(default false; llm_d_epp_extproc_streams_inflight is always exposed)",
    )
    ports.add_argument(
        "--grpc-max-recv-msg-size",
        type=_arg_type(_msg_size),
        default="",
        help="largest ext_proc gRPC message received, a quantity such as 10MiB or 25MB "
        "(default: --max-request-body-bytes + 1 MiB)",
    )
    ports.add_argument(
        "--grpc-max-send-msg-size",
        type=_arg_type(_msg_size),
        default="",
        help="largest ext_proc gRPC message sent (default: --max-request-body-bytes + 1 MiB)",
    )
    ports.add_argument(
        "--extproc-server",
        choices=("epp", "grpcio"),
        default="epp",
        help="the gRPC server of the ext_proc port: epp (default; epp's own HTTP/2 server: the EPP "
        "costs about 3.5x less CPU per 1 KB request than on grpc.aio) or grpcio (grpc.aio); the "
        "health and replication ports always use grpcio",
    )
    _add_h2_limits(p)
    mets.add_argument(
        "--fairness-id-metric-label-limit",
        type=int,
        default=1000,
        help="distinct fairness_id metric label values before the rest record as 'other' "
        "(default 1000; 0: all)",
    )
    _add_decision_flags(p)
    _add_log_flags(p)
    add_reference_flags(p)
    p.set_defaults(func=_serve)


def _add_decision_flags(p: argparse.ArgumentParser) -> None:
    g: Any = p.add_argument_group("explaining decisions and the status page (metrics port)")
    g.add_argument(
        "--decision-ring-size",
        type=int,
        default=100,
        metavar="N",
        help="the last N scheduling decisions shown at /debug/decisions and on /status "
        "(default 100; 0: none)",
    )
    g.add_argument(
        "--decision-log-sample-rate",
        type=float,
        default=0.01,
        metavar="RATE",
        help="share of decisions logged as a request.decision line with the request id, picked endpoint, "
        "runners-up and weighted scores (default 0.01; 0: none; 1: all)",
    )
    add_bool(
        g,
        "--decision-metadata",
        False,
        "put each decision in the routing reply's Envoy dynamic metadata (envoy.lb, key epp.decision: "
        "request_id, profile, picked, summary) for the access log (default false: it builds the "
        "explanation for every request)",
    )
    add_bool(
        g,
        "--decision-response-header",
        False,
        "return each decision to the client in an x-epp-decision response header (needs the response "
        "headers phase; default false; clients cannot ask for it)",
    )
    add_bool(
        g, "--status-page", True, "serve /status (HTML) and /status.json on the metrics port (default true)"
    )


class _PoolNames(argparse.Action):
    """``--pool-name`` repeated: ``pool_names`` lists them all, ``pool_name`` is the first."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None) -> None:
        names = [*(getattr(namespace, "pool_names", None) or []), str(values)]
        namespace.pool_names = names
        namespace.pool_name = names[0]


def _add_h2_limits(p: argparse.ArgumentParser) -> None:
    """The limits of epp's own HTTP/2 server (``--extproc-server epp``) against abusive peers;
    each one that triggers counts in llm_d_epp_extproc_h2_limit_total{limit} (docs/deploy.md)."""
    g = p.add_argument_group("ext_proc HTTP/2 limits (--extproc-server epp)")
    g.add_argument(
        "--h2-max-concurrent-streams",
        type=int,
        default=500,
        help="streams per connection, advertised in SETTINGS; beyond: RST_STREAM REFUSED_STREAM "
        "(default 500)",
    )
    g.add_argument(
        "--h2-max-open-calls",
        type=int,
        default=10_000,
        help="open calls across all connections; beyond: RST_STREAM REFUSED_STREAM (default 10000)",
    )
    g.add_argument(
        "--h2-max-header-block-bytes",
        type=int,
        default=64 << 10,
        help="largest request header block, advertised as MAX_HEADER_LIST_SIZE; beyond: GOAWAY "
        "ENHANCE_YOUR_CALM (default 65536)",
    )
    g.add_argument(
        "--h2-max-header-block-frames",
        type=int,
        default=16,
        help="HEADERS + CONTINUATION frames per header block; beyond: GOAWAY ENHANCE_YOUR_CALM (default 16)",
    )
    g.add_argument(
        "--h2-reset-burst",
        type=int,
        default=1000,
        help="streams a connection may see reset by the client (or refused) before the server "
        "answered, at once; then --h2-reset-rate per second; beyond: GOAWAY ENHANCE_YOUR_CALM "
        "(Rapid Reset; default 1000; 0: no limit)",
    )
    g.add_argument(
        "--h2-reset-rate", type=float, default=100.0, help="see --h2-reset-burst (default 100 per second)"
    )
    g.add_argument(
        "--h2-idle-frame-burst",
        type=int,
        default=1000,
        help="frames that do no work (PING, SETTINGS, PRIORITY, empty DATA, unknown types, ...) a "
        "connection may send at once; then --h2-idle-frame-rate per second; beyond: GOAWAY "
        "ENHANCE_YOUR_CALM (default 1000; 0: no limit)",
    )
    g.add_argument(
        "--h2-idle-frame-rate",
        type=float,
        default=100.0,
        help="see --h2-idle-frame-burst (default 100 per second)",
    )
    g.add_argument(
        "--h2-write-buffer-high",
        type=int,
        default=1 << 20,
        help="bytes queued to a connection's socket (replies, control frames, resets) above which "
        "the server stops reading it (default 1048576)",
    )
    g.add_argument(
        "--h2-write-buffer-low",
        type=int,
        default=256 << 10,
        help="bytes queued below which reading resumes (default 262144)",
    )
    g.add_argument(
        "--h2-write-stall-timeout",
        type=parse_duration,
        default=30.0,
        help="a reply waiting this long for flow-control credit resets its stream (CANCEL); a socket "
        "not drained this long, or a connection window left shut, closes the connection "
        "(default 30s; 0: never)",
    )


def _h2_limits(args: argparse.Namespace) -> Any:
    """The ``--h2-*`` flags as the server's ``Limits`` (SystemExit naming a bad one)."""
    from epp.server.h2grpc import Limits

    limits = Limits(
        max_concurrent_streams=args.h2_max_concurrent_streams,
        max_open_calls=args.h2_max_open_calls,
        max_header_block_bytes=args.h2_max_header_block_bytes,
        max_header_block_frames=args.h2_max_header_block_frames,
        reset_burst=args.h2_reset_burst,
        reset_rate=args.h2_reset_rate,
        idle_frame_burst=args.h2_idle_frame_burst,
        idle_frame_rate=args.h2_idle_frame_rate,
        write_buffer_high=args.h2_write_buffer_high,
        write_buffer_low=args.h2_write_buffer_low,
        write_stall_timeout=args.h2_write_stall_timeout,
    )
    try:
        limits.check()
    except ValueError as e:
        raise SystemExit(f"error: --h2-{str(e).replace('_', '-')}") from None
    return limits


def _arg_type(parse: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse type that reports ``parse``'s ValueError as the argument's error."""

    def convert(text: str) -> str:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _msg_size(text: str) -> str:
    """A gRPC message size flag (a Kubernetes quantity, a trailing B allowed): checked, kept as text."""
    _msg_size_bytes(text)
    return text


def _msg_size_bytes(text: str) -> int:
    """Bytes of a ``--grpc-max-*-msg-size`` value; 0 when unset."""
    from epp.config.schema import parse_quantity
    from epp.framework import ConfigError

    t = text.strip()
    if not t:
        return 0
    if len(t) > 1 and t[-1] in "Bb":
        t = t[:-1]
    try:
        q = parse_quantity(t, "size")
    except ConfigError as e:
        raise ValueError(f"invalid size {text!r}: {e.reason}") from None
    if q is None or q.value < 0:
        raise ValueError(f"must be a non-negative size, got {text!r}")
    if q.value >= 1 << 31:
        raise ValueError(f"must be below 2GiB (a gRPC limit), got {text!r}")
    return q.value


def _verbosity(text: str) -> str:
    from epp import logs

    try:
        return logs.level_from_verbosity(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    from epp import logs

    g = p.add_argument_group("logging")
    g.add_argument(
        "--log-level",
        type=_arg_type(logs.parse_level),
        default=None,
        help="debug, info, warning (or warn), error (default: $EPP_LOG_LEVEL, else info)",
    )
    g.add_argument(
        "--log-format",
        type=_arg_type(logs.parse_format),
        default=None,
        help="json (one object per line) or console (default json, whatever stderr is)",
    )
    g.add_argument(
        "--zap-log-level",
        type=_arg_type(logs.level_from_zap),
        default=None,
        help="llm-d EPP compatibility: zap level debug or info (both info here), warn, error, or a "
        "verbosity N as --v (--log-level wins)",
    )
    g.add_argument(
        "--zap-encoder",
        type=_arg_type(logs.parse_format),
        default=None,
        help="llm-d EPP compatibility: json or console (--log-format wins)",
    )
    g.add_argument(
        "-v",
        "--v",
        type=_verbosity,
        default=None,
        metavar="N",
        help="llm-d EPP compatibility: verbosity N, 4 or more is debug, below 4 info (--zap-log-level wins)",
    )


def _log_settings(args: argparse.Namespace) -> tuple[str, str]:
    """(level, format) from the flags: --log-level, then --zap-log-level, then --v, then
    $EPP_LOG_LEVEL (unless empty), then info; --log-format, then --zap-encoder, then json."""
    from epp import logs

    level = args.log_level or args.zap_log_level or args.v
    if level is None:
        env = os.environ.get("EPP_LOG_LEVEL")
        try:
            level = logs.parse_level(env) if env else "info"
        except ValueError as e:
            print(f"epp serve: error: EPP_LOG_LEVEL: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    devel = "console" if getattr(args, "zap_devel", False) else None
    return level, args.log_format or args.zap_encoder or devel or "json"


def _positive_duration(text: str) -> float:
    value = parse_duration(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive duration, got {text!r}")
    return value


def _target_ports(text: str) -> tuple[int, ...]:
    ports: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or not 1 <= int(part) <= 65535:
            raise SystemExit(f'error: invalid port number {part} in "endpoint-target-ports"')
        if int(part) not in ports:
            ports.append(int(part))
    if not 1 <= len(ports) <= 8:
        raise SystemExit('error: flag "endpoint-target-ports" should have length from 1 to 8')
    return tuple(ports)


def _standalone_pool_name(pod_name: str) -> str:
    """The Deployment's name from POD_NAME (``<deployment>-<replicaset hash>-<suffix>``)."""
    parts = pod_name.split("-")
    return "-".join(parts[:-2]) if len(parts) > 2 else pod_name or "epp"


def _advertise_address(args: argparse.Namespace) -> str:
    """``--ha-advertise-address``, else ``$POD_IP`` (downward API) or the host's address, with the
    replication port."""
    if args.ha_advertise_address is not None:
        return str(args.ha_advertise_address)
    host = os.environ.get("POD_IP", "")
    if not host:
        import socket

        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = ""
        if not host or host.startswith("127."):
            # another replica can't reach us there (nor should it follow itself): no replication
            print(
                "warning: no POD_IP and no routable host address: standbys will not mirror the "
                "leader's prefix index (set --ha-advertise-address)",
                file=sys.stderr,
            )
            return ""
    port = args.ha_replication_port
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _kube_options(args: argparse.Namespace, file_discovery: bool) -> Any:
    """The Kubernetes options, or None with file discovery; ``SystemExit`` on conflicting flags."""
    from epp.k8s.pool_discovery import parse_endpoint_selector
    from epp.k8s.runtime import KubeOptions

    if file_discovery:
        if args.endpoint_selector:
            raise SystemExit(
                "error: dataLayer.discovery and --endpoint-selector are both set; "
                "use exactly one endpoint source"
            )
        if args.ha_enable_leader_election:
            raise SystemExit("error: --ha-enable-leader-election needs Kubernetes discovery (--pool-name)")
        return None
    pool_names = tuple(dict.fromkeys(getattr(args, "pool_names", None) or ()))
    if args.pool_selector and args.endpoint_selector:
        raise SystemExit("error: --pool-selector and --endpoint-selector are exclusive")
    if args.pool_selector:
        try:
            parse_endpoint_selector(args.pool_selector)
        except ValueError as e:
            raise SystemExit(f'error: invalid "pool-selector": {e}') from None
    if bool(args.pool_name or args.pool_selector) == bool(args.endpoint_selector):
        hint = (
            ""
            if args.pool_name
            else " (Kubernetes discovery); without Kubernetes, list the endpoints in a file with the "
            "file-discovery plugin (README.md, 'Endpoints without Kubernetes')"
        )
        raise SystemExit(f"error: either pool-name or endpoint-selector must be set{hint}")
    if not args.pool_namespace and not args.pool_selector:
        raise SystemExit(
            'error: "pool-namespace" must not be empty (but with --pool-selector: every namespace)'
        )
    port = args.model_server_metrics_port
    if port is not None and not 1 <= port <= 65535:
        raise SystemExit(f'error: invalid port number {port} in "model-server-metrics-port"')
    opts = KubeOptions(
        namespace=args.pool_namespace,
        pool_name=args.pool_name,
        pool_names=pool_names if len(pool_names) > 1 or args.pool_selector else (),
        pool_selector=args.pool_selector,
        pool_group=args.pool_group,
        kubeconfig=args.kubeconfig,
        metrics_port=args.model_server_metrics_port,
        leader_election=args.ha_enable_leader_election,
        lease_duration=args.ha_lease_duration,
        renew_deadline=args.ha_renew_deadline,
        retry_period=args.ha_retry_period,
        lease_name=args.ha_lease_name,
        pod_name=os.environ.get("POD_NAME", ""),
        advertise_address=_advertise_address(args) if args.ha_enable_leader_election else "",
    )
    if args.endpoint_selector:
        try:
            opts.selector = parse_endpoint_selector(args.endpoint_selector)
        except ValueError as e:
            raise SystemExit(f'error: invalid "endpoint-selector": {e}') from None
        opts.target_ports = _target_ports(args.endpoint_target_ports)
    elif args.endpoint_target_ports:
        raise SystemExit('error: "endpoint-target-ports" is only used with "endpoint-selector"')
    if not 1 <= args.ha_replication_port <= 65535:
        raise SystemExit(f'error: invalid port number {args.ha_replication_port} in "ha-replication-port"')
    if opts.leader_election and not opts.lease_duration > opts.renew_deadline > opts.retry_period > 0:
        raise SystemExit(
            "error: leader election needs --ha-lease-duration > --ha-renew-deadline > --ha-retry-period > 0"
        )
    return opts


def _check_tls(args: argparse.Namespace) -> None:
    """Refuse contradictory TLS flags and unusable certificate files before anything starts."""
    from epp.server.tls import CA_FILE, CertificateFiles, TlsFileError

    if args.grpc_client_ca_file and not (args.secure_serving and args.cert_path):
        raise SystemExit("error: --grpc-client-ca-file needs --secure-serving and --cert-path")
    checks: list[tuple[str, CertificateFiles]] = []
    if args.secure_serving and args.cert_path:
        checks.append(("--cert-path", CertificateFiles(args.cert_path, args.grpc_client_ca_file)))
    if args.ha_replication_cert_path:
        path = args.ha_replication_cert_path
        checks.append(("--ha-replication-cert-path", CertificateFiles(path, Path(path) / CA_FILE)))
    for flag, files in checks:
        try:
            files.load()
        except TlsFileError as e:
            raise SystemExit(f"error: {flag}: {e}") from None


def _check_stream_limits(args: argparse.Namespace) -> None:
    budget, largest = args.max_buffered_request_body_bytes, args.max_request_body_bytes
    if budget < 0 or (budget and budget < largest):
        raise SystemExit(
            f"error: --max-buffered-request-body-bytes={budget}: must be 0 (no limit) or at least "
            f"--max-request-body-bytes ({largest})"
        )
    if not 0 <= args.request_idle_timeout < math.inf:
        raise SystemExit(
            f"error: --request-idle-timeout={args.request_idle_timeout}: must be a finite duration "
            "(0: no idle timeout)"
        )


def _objectives(path: str, pool_name: str, *, kube: bool) -> Any:
    """The ``--objectives-file`` priorities (None without the flag); exits 2 naming a bad field."""
    if not path:
        return None
    if kube:
        raise SystemExit(
            "error: --objectives-file is for endpoints without Kubernetes: with --pool-name or "
            "--endpoint-selector, priorities come from the cluster's InferenceObjectives"
        )
    from epp.datalayer.objectives_file import ObjectivesFileError, load_objectives_file

    try:
        return load_objectives_file(path, pool_name)
    except ObjectivesFileError as e:
        print(f"error: --objectives-file {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _pool_config(args: argparse.Namespace) -> Callable[[Any, str | None], Any]:
    """Loads a config for another pool's endpoint store (an EPP serving several pools): the shared
    config's text, or (``own`` not None) the pool's own text."""
    from epp.config import load_config

    text, source = _config_text(args)

    def load(store: Any, own: str | None = None) -> Any:
        return load_config(
            text if own is None else own,
            source=source if own is None else "pool config",
            endpoints=store.endpoints,
            **_config_options(args),
        )

    return load


def _serve(args: argparse.Namespace) -> int:
    notes = check_reference_flags(args)  # first: it may configure gRPC before gRPC is loaded
    from epp import labels, logs
    from epp.datalayer.store import EndpointStore
    from epp.server.app import EppServer, ServeOptions

    logs.configure(*_log_settings(args))
    if notes:
        import structlog

        for flag, instead in notes:
            structlog.get_logger("epp").warning("flag accepted but not honoured", flag=flag, detail=instead)
    _check_tls(args)
    if args.fairness_id_metric_label_limit < 0:
        raise SystemExit(
            "error: fairness-id-metric-label-limit must be non-negative, "
            f"got {args.fairness_id_metric_label_limit}"
        )
    labels.FAIRNESS_IDS.reset(args.fairness_id_metric_label_limit)
    _check_stream_limits(args)
    store = EndpointStore()
    cfg = _load(
        *_config_text(args),
        endpoints=store.endpoints,
        log_warnings=True,
        **_config_options(args),
    )
    kube_opts = _kube_options(args, file_discovery=cfg.discovery is not None)
    watch = _config_watch(args, store.endpoints)
    pool_name = args.pool_name
    if not pool_name and args.endpoint_selector:
        pool_name = _standalone_pool_name(os.environ.get("POD_NAME", ""))
    objectives = _objectives(args.objectives_file, pool_name or "epp", kube=kube_opts is not None)
    opts = ServeOptions(
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        grpc_socket=args.grpc_socket,
        extproc_server=args.extproc_server,
        metrics_port=args.metrics_port,
        bind_address=args.bind_address,
        secure_serving=args.secure_serving,
        cert_path=args.cert_path,
        client_ca_file=args.grpc_client_ca_file,
        enable_cert_reload=args.enable_cert_reload,
        replication_port=args.ha_replication_port,
        replication_cert_path=args.ha_replication_cert_path,
        health_checking=args.health_checking,
        pool_name=pool_name or "epp",
        pool_namespace=args.pool_namespace,
        refresh_metrics_interval=args.refresh_metrics_interval,
        refresh_prometheus_metrics_interval=args.refresh_prometheus_metrics_interval,
        metrics_staleness_threshold=args.metrics_staleness_threshold,
        metrics_scrape_timeout=args.metrics_scrape_timeout or 0.0,
        disable_endpoint_subset_filter=args.disable_endpoint_subset_filter,
        max_request_body_bytes=args.max_request_body_bytes,
        max_buffered_request_body_bytes=args.max_buffered_request_body_bytes,
        request_idle_timeout=args.request_idle_timeout,
        debug_response_header=args.debug_response_header,
        allow_model_rewrite_header=args.allow_model_rewrite_header,
        grace_period=args.grace_period,
        drain_delay=args.drain_delay,
        metrics_endpoint_auth=bool(args.metrics_endpoint_auth),
        emit_endpoint_scores=args.emit_endpoint_scores,
        decision_ring_size=max(args.decision_ring_size, 0),
        decision_log_sample_rate=min(max(args.decision_log_sample_rate, 0.0), 1.0),
        decision_metadata=args.decision_metadata,
        decision_response_header=args.decision_response_header,
        status_page=args.status_page,
        emit_deprecated_metrics=args.emit_deprecated_metrics,
        skip_unused_response_phases=args.skip_unused_response_phases,
        grpc_stream_metrics=args.enable_grpc_stream_metrics,
        grpc_max_recv_msg_size=_msg_size_bytes(args.grpc_max_recv_msg_size),
        grpc_max_send_msg_size=_msg_size_bytes(args.grpc_max_send_msg_size),
        h2_limits=_h2_limits(args),
    )
    if args.metrics_endpoint_auth and kube_opts is None:
        raise SystemExit(
            "error: --metrics-endpoint-auth needs Kubernetes discovery (--pool-name or --endpoint-selector)"
        )
    if args.metrics_endpoint_auth is None and kube_opts is not None:
        import structlog

        structlog.get_logger("epp").warning(
            "/metrics is served without authentication: pass --metrics-endpoint-auth to require a token "
            "the cluster authorizes (the llm-d EPP's default), or --metrics-endpoint-auth=false",
        )

    if args.tracing:
        from epp import tracing

        try:
            tracing.configure()
        except tracing.TracingConfigError as e:
            raise SystemExit(f"error: --tracing: {e}") from None

    several = kube_opts is not None and (kube_opts.pool_names or kube_opts.pool_selector)
    pool_config = _pool_config(args) if cfg.discovery is not None or several else None

    async def main() -> None:
        kube = None
        if kube_opts is not None:
            from epp.k8s.client import KubeConfigError
            from epp.k8s.runtime import KubeRuntime

            try:
                kube = await KubeRuntime.build(
                    kube_opts, pool_name=opts.pool_name, app_protocols=cfg.parsers.supported_app_protocols()
                )
            except KubeConfigError as e:
                raise SystemExit(f"error: {e}") from None
        await EppServer(
            cfg, opts, store, kube=kube, objectives=objectives, config_watch=watch, pool_config=pool_config
        ).run()

    try:
        run_async(main)
    except SystemExit:
        raise
    except Exception as e:
        import structlog

        structlog.get_logger("epp").error("epp failed", error=str(e), error_type=type(e).__name__)
        return 1
    finally:
        if args.tracing:
            from epp import tracing

            tracing.shutdown()  # flush the last spans
    return 0


# --- check-config -----------------------------------------------------------------------------


def _add_allow_experimental(p: Any) -> None:
    add_bool(
        p,
        "--allow-experimental-plugins",
        False,
        "load plugin types of alpha stability (`epp plugins` lists them); without it they are an error",
    )
    p.add_argument(
        "--feature-gates",
        type=parse_feature_gates,
        default=None,
        metavar="GATES",
        help="feature gates as name=true|false pairs, comma-separated (kubelet style); they override "
        "the config's featureGates",
    )
    p.add_argument(
        "--compat-version",
        choices=("v0.11",),
        default="",
        help="refuse what that router version removed (v0.11: precise-prefix-cache-scorer, tokenizer, "
        "by-label, by-label-selector, disagg-headers-handler, prefill-header-handler, "
        "pd-profile-handler, the flat disagg-profile-handler parameters); default: load them with a "
        "warning naming the replacement",
    )


def _config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The loader options of the config flags (``_add_allow_experimental``)."""
    return {
        "allow_experimental": args.allow_experimental_plugins,
        "feature_gates": args.feature_gates,
        "compat_version": args.compat_version,
    }


def _add_check(sub: Any) -> None:
    p = sub.add_parser(
        "check-config",
        help="validate an EndpointPickerConfig and print the effective config",
        description="Writes the effective configuration (every default filled in) as YAML to standard "
        "output and nothing else; warnings, errors and plugin logs go to standard error.",
    )
    p.add_argument("file", help="config file ('-' for standard input)")
    p.add_argument(
        "--output",
        "-o",
        choices=("v1", "v1alpha1"),
        default="v1",
        help="layout of the printed config: v1 (llm-d.ai/v1, default) or the deprecated v1alpha1",
    )
    _add_allow_experimental(p)
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    from epp import logs

    logs.configure("info", "console")  # stderr: standard output carries only the effective config
    text = sys.stdin.read() if args.file == "-" else None
    if text is None:
        try:
            text = Path(args.file).read_text()
        except FileNotFoundError:
            print(f"error: config file {args.file} does not exist", file=sys.stderr)
            return 2
        except (OSError, UnicodeDecodeError) as e:
            print(
                f"error: cannot read config file {args.file}: {getattr(e, 'strerror', None) or e}",
                file=sys.stderr,
            )
            return 2
    cfg = _load(text, args.file, **_config_options(args))
    from epp.config.effective import OUTPUT_VERSIONS

    sys.stdout.write(cfg.effective_yaml(OUTPUT_VERSIONS[args.output]))
    return 0


# --- plugins ----------------------------------------------------------------------------------


def _add_plugins(sub: Any) -> None:
    p = sub.add_parser(
        "plugins",
        help="list the registered plugin types",
        description="Every registered plugin type with its kinds, stability, deprecated names and "
        "parameters (with their defaults).",
    )
    p.add_argument("--output", "-o", choices=("text", "json"), default="text", help="text (default) or json")
    p.set_defaults(func=_plugins)


def _plugins(args: argparse.Namespace) -> int:
    import json

    from epp import logs
    from epp.config import catalog

    logs.configure("warning", "console")
    if args.output == "json":
        sys.stdout.write(json.dumps(catalog.describe(), indent=2) + "\n")
    else:
        sys.stdout.write(catalog.render_text())
    return 0


# --- certs ----------------------------------------------------------------------------------


def _add_certs(sub: Any) -> None:
    p = sub.add_parser(
        "certs",
        help="write a CA, the EPP's certificate and a client certificate (for Kubernetes Secrets)",
        description="Writes OUT/ca.crt and ca.key (keep ca.key private), OUT/epp/{tls.crt,tls.key,ca.crt} "
        "(server and client usage; names epp, epp-replica, localhost, 127.0.0.1 and every --dns-name) and "
        "OUT/envoy/{tls.crt,tls.key,ca.crt} (client only), then prints the kubectl commands that create "
        "the Secrets epp-tls and epp-envoy-tls the manifests mount.",
    )
    p.add_argument(
        "--out",
        required=True,
        help="directory to write into (created); the run writes nothing if any of the files exists "
        "there already (remove them, or choose another directory)",
    )
    p.add_argument(
        "--dns-name",
        action="append",
        default=[],
        help="another name the EPP's certificate carries, e.g. epp.NAMESPACE.svc (repeatable)",
    )
    p.add_argument(
        "--days", type=int, default=365, help="validity of the EPP and Envoy certificates (default 365)"
    )
    p.set_defaults(func=_certs)


def _certs(args: argparse.Namespace) -> int:
    from epp.server.tls import REPLICA_NAME, Authority, KeyPair

    out = Path(args.out)
    if not 1 <= args.days <= 3650:
        print("error: --days must be between 1 and 3650", file=sys.stderr)
        return 2
    names = ["epp", REPLICA_NAME, "localhost", *args.dns_name]
    targets = [out / "ca.crt", out / "ca.key", out / "epp", out / "envoy"]
    existing = [str(t) for t in targets if t.exists()]
    if existing:
        print(
            f"error: would overwrite {', '.join(existing)}: nothing was written; remove them or choose "
            "another --out directory",
            file=sys.stderr,
        )
        return 2
    ca = Authority.create()
    pairs: dict[str, KeyPair] = {
        "epp": ca.issue("epp", dns_names=names, ip_addresses=["127.0.0.1"], client=True, days=args.days),
        "envoy": ca.issue("envoy", server=False, client=True, days=args.days),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ca.crt").write_bytes(ca.cert)
    (out / "ca.key").write_bytes(ca.key)
    (out / "ca.key").chmod(0o600)
    for name, pair in pairs.items():
        (out / name).mkdir()
        (out / name / "tls.crt").write_bytes(pair.cert)
        (out / name / "tls.key").write_bytes(pair.key)
        (out / name / "tls.key").chmod(0o600)
        (out / name / "ca.crt").write_bytes(ca.cert)
    print(f"wrote {out}/ca.crt, {out}/ca.key, {out}/epp/ and {out}/envoy/; create the Secrets with:")
    for secret, name in (("epp-tls", "epp"), ("epp-envoy-tls", "envoy")):
        files = " ".join(f"--from-file={out / name / f}" for f in ("tls.crt", "tls.key", "ca.crt"))
        print(f"  kubectl -n NAMESPACE create secret generic {secret} --type=kubernetes.io/tls {files}")
    return 0


# --- sim, run ---------------------------------------------------------------------------------


def _add_sim(sub: Any) -> None:
    from epp.dev.sim import cli as sim_cli

    p = sub.add_parser("sim", help="run a simulated OpenAI-compatible vLLM server")
    sim_cli.add_arguments(p)
    p.set_defaults(func=sim_cli.main)


def _add_pd_sidecar(sub: Any) -> None:
    from epp.sidecar import cli as sidecar_cli

    p = sub.add_parser(
        "pd-sidecar", help="run the decode-side P/D sidecar (reverse proxy before the decode engine)"
    )
    sidecar_cli.add_arguments(p)
    p.set_defaults(func=sidecar_cli.main)


def _add_run(sub: Any) -> None:
    from epp.dev.stack import cli as stack_cli

    p = sub.add_parser("run", help="run a local stack: Envoy on :8081, the EPP and simulated vLLM servers")
    stack_cli.add_arguments(p)
    p.set_defaults(func=stack_cli.main)


def _add_envoy_config(sub: Any) -> None:
    p = sub.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap for the EPP (response phases derived from --config-file)",
        description="The generator of python -m epp.dev.envoy; `epp envoy-config --help` lists its flags.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_envoy_config)


def _envoy_config(args: argparse.Namespace) -> int:
    from epp import logs
    from epp.dev.envoy.cli import main as envoy_main

    logs.configure("warning", "console")  # standard output carries only the bootstrap
    return envoy_main(args.args, prog="epp envoy-config")


# Each subcommand and what adds its parser (the order of ``epp --help``; then explain and status).
_COMMANDS: dict[str, Callable[[Any], None]] = {
    "serve": _add_serve,
    "sim": _add_sim,
    "run": _add_run,
    "pd-sidecar": _add_pd_sidecar,
    "check-config": _add_check,
    "plugins": _add_plugins,
    "certs": _add_certs,
    "envoy-config": _add_envoy_config,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``epp`` parser with every subcommand, or with ``command``'s alone when it is one of
    ``_COMMANDS``: the same parse of ``epp COMMAND ...`` without importing every other command's
    modules (a simulator then starts without the plugins, the EPP without the simulator)."""
    parser = argparse.ArgumentParser(prog="epp", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    if command in _COMMANDS:
        _COMMANDS[command](sub)
        return parser
    for add in _COMMANDS.values():
        add(sub)
    observe.add_commands(sub)  # explain, status
    return parser


def _go_bool_flags(argv: Sequence[str]) -> list[str]:
    """A bare ``--allow-experimental-plugins`` means ``=true`` and never takes the next argument
    (as with Go flags), so ``check-config --allow-experimental-plugins FILE`` keeps its file."""
    flag = "--allow-experimental-plugins"
    return [f"{flag}=true" if a == flag else a for a in argv]


_PASS_THROUGH_FLAGS = frozenset(("--sim-arg", "--epp-arg"))


def _pass_through_values(argv: Sequence[str]) -> list[str]:
    """``--sim-arg --max-num-seqs=2`` means ``--sim-arg=--max-num-seqs=2`` (``--epp-arg`` alike): a
    flag whose value is another program's flag takes the next argument even when it starts with
    ``-``."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--":
            out.append(a)
            out.extend(it)
            break
        if a in _PASS_THROUGH_FLAGS:
            value = next(it, None)
            out.append(a if value is None else f"{a}={value}")
        else:
            out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["envoy-config"]:  # its own parser (flags and --help of python -m epp.dev.envoy)
        return _envoy_config(argparse.Namespace(args=argv[1:]))
    if argv[:1] == ["run"]:
        argv = _pass_through_values(argv)
    args = build_parser(argv[0] if argv else None).parse_args(_go_bool_flags(argv))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
