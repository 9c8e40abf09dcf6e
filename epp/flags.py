"""Go-style flag values shared by the subcommands (``--flag=false`` booleans, durations), and the
flags of the reference EPP (llm-d-router) that ``epp serve`` accepts for drop-in use but that need
more than a one-to-one mapping: refused ones, TLS settings handed to gRPC, ones only logged.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from epp.framework.durations import parse_go_duration


def parse_duration(text: str) -> float:
    """A Go duration (``50ms``, ``2s``, ``1m30s``) or a plain number of seconds -> seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    seconds = parse_go_duration(text)
    if seconds is None:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 50ms, 2s, 1m30s)")
    return seconds


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes", "on"):
        return True
    if value in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


def parse_port(text: str) -> int:
    """A port number as the reference's uint16 flags take it: 0 (any free port) to 65535."""
    try:
        port = int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: not an integer") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: out of range 0-65535 (uint16)")
    return port


def parse_feature_gates(text: str) -> dict[str, bool]:
    """``--feature-gates`` in kubelet style: ``a=true,b=false`` (a bare name means true)."""
    gates: dict[str, bool] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not name:
            raise argparse.ArgumentTypeError(f"invalid feature gate {item!r}: missing name")
        try:
            gates[name] = parse_bool(value) if sep else True
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"invalid value of feature gate {name}: {value!r} (expected true or false)"
            ) from None
    return gates


def add_bool(parser: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    """``--name``, ``--name=true`` and ``--name=false`` all work, as with Go flags."""
    parser.add_argument(
        name, type=parse_bool, nargs="?", const=True, default=default, metavar="BOOL", help=help
    )


# Superseded by engineConfigs in the config; the reference refuses them when set.
_DEPRECATED_METRIC_FLAGS = (
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
    "lora-info-metric",
    "cache-info-metric",
)
_TLS_VERSIONS = ("VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")
# Go crypto/tls suite names (TLS 1.2 and below) -> the BoringSSL names gRPC's TLS stack takes.
_CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
}
# TLS 1.3 suites: always enabled, not configurable (as in Go); accepted and skipped.
_TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
# Go names of suites gRPC's TLS stack no longer implements (3DES, RC4, CBC with SHA-256).
_UNSUPPORTED_SUITES = (
    "TLS_RSA_WITH_RC4_128_SHA",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256",
)
_ZAP_LEVELS = ("debug", "info", "warn", "error", "dpanic", "panic", "fatal")
_ZAP_TIME_ENCODINGS = ("epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano")


def _choice(*values: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r}: must be one of {', '.join(values)}")
        return text

    return convert


def add_reference_flags(p: argparse.ArgumentParser) -> None:
    o: Any = p.add_argument_group("observability")
    add_bool(
        o,
        "--tracing",
        False,
        "emit OpenTelemetry traces, configured by the OTEL_* environment (default false; a local "
        "recipe in docs/deploy.md, 'Tracing')",
    )
    g: Any = p.add_argument_group("llm-d EPP flags (accepted for drop-in compatibility; see docs/compat.md)")
    g.add_argument(
        "--drain-timeout",
        dest="drain_delay",
        type=parse_duration,
        default=argparse.SUPPRESS,
        metavar="DURATION",
        help="the reference's name of --drain-delay: keep serving this long after SIGTERM turned "
        "readiness NOT_SERVING",
    )
    g.add_argument(
        "--tls-min-version",
        type=_choice(*_TLS_VERSIONS),
        default=None,
        help="minimum TLS version of the ext_proc listener: VersionTLS12 (gRPC's minimum: lower "
        "values serve TLS 1.2 and up); VersionTLS13 is refused",
    )
    g.add_argument(
        "--tls-cipher-suites",
        default="",
        help="comma-separated Go crypto/tls suite names for TLS 1.2 (TLS 1.3 suites are not "
        "configurable); applies to every TLS listener and client of the process",
    )
    g.add_argument(
        "--metrics-endpoint-auth",
        type=parse_bool,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="Kubernetes mode: /metrics only for bearer tokens the cluster authenticates (TokenReview) "
        "and authorizes for get on the path (SubjectAccessReview); default false (the reference's is "
        "true: unset, a start-up warning says so)",
    )
    g.add_argument("--metrics-cert-dir", default="", help="not supported (refused): /metrics is plain HTTP")
    g.add_argument("--metrics-client-ca-file", default="", help="not supported (refused)")
    g.add_argument(
        "--enable-pprof",
        type=parse_bool,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="Go profiling handlers: not available (true is logged at start-up)",
    )
    add_bool(
        g,
        "--zap-devel",
        False,
        "zap development mode: console log format unless --log-format or --zap-encoder is given",
    )
    g.add_argument(
        "--zap-stacktrace-level",
        type=_choice(*_ZAP_LEVELS),
        default=None,
        help="not honoured (logged): exceptions are always logged with their traceback",
    )
    g.add_argument(
        "--zap-time-encoding",
        type=_choice(*_ZAP_TIME_ENCODINGS),
        default=None,
        help="not honoured (logged): timestamps are ISO 8601 in UTC",
    )
    for name in _DEPRECATED_METRIC_FLAGS:
        g.add_argument(f"--{name}", default=None, help="refused as in the reference: use engineConfigs")
    g.add_argument(
        "--plugin-state-staleness-threshold",
        type=parse_duration,
        default=300.0,
        metavar="DURATION",
        help="router v0.11's reaper of per-request plugin state (default 5m); epp keeps that state in "
        "the request's own cycle state, dropped when its stream ends, so there is nothing to reap",
    )


def _tls_cipher_list(text: str) -> str:
    """``--tls-cipher-suites`` as gRPC's cipher list (``a:b``); "" for gRPC's defaults."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name or name in _TLS13_SUITES:
            continue
        if name in _UNSUPPORTED_SUITES:
            raise SystemExit(
                f"error: invalid tls-cipher-suites: {name} is not supported by epp's TLS stack (BoringSSL)"
            )
        if name not in _CIPHER_SUITES:
            raise SystemExit(f'error: invalid tls-cipher-suites: unknown cipher suite "{name}"')
        if _CIPHER_SUITES[name] not in names:
            names.append(_CIPHER_SUITES[name])
    return ":".join(names)


def check_reference_flags(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Check the reference-only flags; ``SystemExit`` for refused ones. Applies the TLS cipher list
    (gRPC reads it once, when first used: this must run before grpc is imported). Returns
    (flag, what happens instead) for every flag accepted but not honoured, to log once."""
    for name in _DEPRECATED_METRIC_FLAGS:
        if getattr(args, name.replace("-", "_")) is not None:
            raise SystemExit(
                f'error: flag "{name}" is deprecated and cannot be used; configure metrics via '
                "engineConfigs in EndpointPickerConfig instead"
            )
    for flag in ("metrics_cert_dir", "metrics_client_ca_file"):
        if getattr(args, flag):
            raise SystemExit(
                f"error: --{flag.replace('_', '-')} is not supported: epp serves /metrics over plain HTTP "
                "(put it behind a NetworkPolicy or a TLS-terminating proxy)"
            )
    if args.tls_min_version == "VersionTLS13":
        raise SystemExit(
            "error: --tls-min-version=VersionTLS13 is not supported: gRPC's Python API cannot refuse "
            "TLS 1.2 (its minimum is TLS 1.2)"
        )
    ciphers = _tls_cipher_list(args.tls_cipher_suites)
    if ciphers:
        if "grpc" in sys.modules:  # in-process callers (tests): too late for this process
            raise SystemExit("error: --tls-cipher-suites must be applied before gRPC is loaded")
        os.environ["GRPC_SSL_CIPHER_SUITES"] = ciphers
    if args.plugin_state_staleness_threshold <= 0:
        raise SystemExit("error: --plugin-state-staleness-threshold must be positive")
    notes: list[tuple[str, str]] = []
    if args.plugin_state_staleness_threshold != 300.0:
        notes.append(
            (
                "--plugin-state-staleness-threshold",
                "per-request plugin state is dropped with its stream (idle streams end after "
                "--request-idle-timeout), never left to go stale",
            )
        )
    if args.tls_min_version in ("VersionTLS10", "VersionTLS11"):
        notes.append(("--tls-min-version", "TLS 1.0 and 1.1 are never served: the minimum is TLS 1.2"))
    if args.enable_pprof:
        notes.append(("--enable-pprof", "Go profiling handlers do not exist in epp; nothing is served"))
    if args.zap_stacktrace_level is not None:
        notes.append(("--zap-stacktrace-level", "exceptions are always logged with their traceback"))
    if args.zap_time_encoding is not None:
        notes.append(("--zap-time-encoding", "timestamps are ISO 8601 in UTC"))
    return notes
