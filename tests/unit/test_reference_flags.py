"""Flags of the reference EPP that ``epp serve`` accepts for drop-in use: refused ones fail with the
reference's (or a precise) error, the honoured ones change behaviour, the rest are logged once."""

from __future__ import annotations

import argparse
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from epp import cli
from epp import flags as epp_flags
from epp.dev.stack import free_port, grpc_serving

FILE_CONFIG = (
    "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
    "- {{name: files, type: file-discovery, parameters: {{path: {path}}}}}\n"
    "dataLayer: {{discovery: {{pluginRef: files}}}}\n"
)


# Every flag of the reference's `epp` command: its server options and its logging options (--v and
# controller-runtime's zap flags).
REFERENCE_FLAGS = {
    "grpc-port", "ha-enable-leader-election", "drain-timeout", "grpc-max-recv-msg-size",
    "grpc-max-send-msg-size", "pool-group", "pool-namespace", "pool-name", "endpoint-selector",
    "endpoint-target-ports", "disable-endpoint-subset-filter", "emit-endpoint-scores",
    "refresh-metrics-interval", "refresh-prometheus-metrics-interval", "metrics-staleness-threshold",
    "total-queued-requests-metric", "total-running-requests-metric", "kv-cache-usage-percentage-metric",
    "lora-info-metric", "cache-info-metric", "v", "zap-devel", "zap-encoder", "zap-log-level",
    "zap-stacktrace-level", "zap-time-encoding", "tracing", "health-checking", "metrics-port",
    "grpc-health-port", "enable-pprof", "cert-path", "enable-cert-reload", "enable-grpc-stream-metrics",
    "secure-serving", "tls-min-version", "tls-cipher-suites", "metrics-endpoint-auth",
    "metrics-client-ca-file", "metrics-cert-dir", "config-file", "config-text",
    "allow-experimental-plugins",
}  # fmt: skip
# Added on other branches (stream metrics, endpoint scores, gRPC message sizes, plugin stability).
ELSEWHERE = {
    "emit-endpoint-scores", "enable-grpc-stream-metrics", "grpc-max-recv-msg-size",
    "grpc-max-send-msg-size", "allow-experimental-plugins",
}  # fmt: skip


def test_every_reference_flag_is_accepted() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    known = {o.removeprefix("--") for o in sub.choices["serve"]._option_string_actions}
    assert REFERENCE_FLAGS - ELSEWHERE - known == set()


def _serve_args(*flags: str) -> list[str]:
    return ["serve", "--secure-serving=false", *flags]


@pytest.mark.parametrize(
    "flag",
    [
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
        "lora-info-metric",
        "cache-info-metric",
    ],
)
def test_deprecated_metric_flags_are_refused_as_in_the_reference(flag: str) -> None:
    with pytest.raises(
        SystemExit, match=f'flag "{flag}" is deprecated and cannot be used; configure metrics'
    ):
        cli.main(_serve_args(f"--{flag}=vllm:whatever"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-cert-dir=/tmp"], "--metrics-cert-dir is not supported"),
        (["--metrics-client-ca-file=/tmp/ca.crt"], "--metrics-client-ca-file is not supported"),
        (["--tls-min-version=VersionTLS13"], "VersionTLS13 is not supported"),
        (["--tls-cipher-suites=TLS_FOO"], 'unknown cipher suite "TLS_FOO"'),
        (["--tls-cipher-suites=TLS_RSA_WITH_RC4_128_SHA"], "TLS_RSA_WITH_RC4_128_SHA is not supported"),
    ],
)
def test_flags_epp_cannot_honour_safely_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        cli.main(_serve_args(*flags))


def test_metrics_endpoint_auth_needs_kubernetes(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 1}\n")
    config = FILE_CONFIG.format(path=endpoints)
    with pytest.raises(SystemExit, match="--metrics-endpoint-auth needs Kubernetes discovery"):
        cli.main(_serve_args("--metrics-endpoint-auth", "--config-text", config))


def test_bad_values_are_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--tls-min-version=TLS12", "--zap-time-encoding=weird", "--tracing=maybe"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(_serve_args(flag))
        assert exit_.value.code == 2
        assert flag.split("=")[0] in capsys.readouterr().err


def test_drain_timeout_is_the_drain_delay() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--drain-timeout=30s"]).drain_delay == 30.0
    assert parser.parse_args(["serve", "--drain-delay=2s"]).drain_delay == 2.0
    assert parser.parse_args(["serve"]).drain_delay == 1.0
    assert parser.parse_args(["serve", "--tracing=true"]).tracing is True
    assert parser.parse_args(["serve"]).tracing is False


def test_zap_devel_means_console_logs_unless_a_format_is_given() -> None:
    parser = cli.build_parser()
    assert cli._log_settings(parser.parse_args(["serve", "--zap-devel"]))[1] == "console"
    assert cli._log_settings(parser.parse_args(["serve", "--zap-devel", "--zap-encoder=json"]))[1] == "json"
    assert cli._log_settings(parser.parse_args(["serve"]))[1] == "json"


def test_accepted_but_not_honoured_flags_are_named() -> None:
    parser = cli.build_parser()
    notes = epp_flags.check_reference_flags(
        parser.parse_args(
            [
                "serve",
                "--enable-pprof",
                "--zap-stacktrace-level=error",
                "--zap-time-encoding=epoch",
                "--tls-min-version=VersionTLS10",
                "--tls-cipher-suites=TLS_AES_128_GCM_SHA256",  # TLS 1.3: not configurable, skipped
            ]
        )
    )
    assert [flag for flag, _ in notes] == [
        "--tls-min-version",
        "--enable-pprof",
        "--zap-stacktrace-level",
        "--zap-time-encoding",
    ]
    assert epp_flags.check_reference_flags(parser.parse_args(["serve", "--enable-pprof=false"])) == []


def _handshake(port: int, cipher: str) -> str:
    """The cipher a TLS 1.2 client offering only ``cipher`` (OpenSSL name) agrees on, or "refused"."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(cipher)
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
            return str(tls.cipher()[0])
    except (ssl.SSLError, OSError):
        return "refused"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., int]]:
    procs: list[subprocess.Popen[str]] = []
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 1}\n")

    def start(*flags: str) -> int:
        grpc_port, health_port = free_port(), free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "epp",
                "serve",
                f"--grpc-port={grpc_port}",
                f"--grpc-health-port={health_port}",
                f"--metrics-port={free_port()}",
                "--config-text",
                FILE_CONFIG.format(path=endpoints),
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        deadline = time.monotonic() + 30
        while not grpc_serving(health_port):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "epp never became ready"
            time.sleep(0.05)
        return grpc_port

    yield start
    for proc in procs:
        proc.terminate()
        proc.communicate(timeout=30)


def test_tls_cipher_suites_restrict_the_ext_proc_listener(serve: Callable[..., int]) -> None:
    start = serve  # the self-signed certificate has an EC key: ECDSA suites
    default = start()
    assert _handshake(default, "ECDHE-ECDSA-AES256-GCM-SHA384") == "ECDHE-ECDSA-AES256-GCM-SHA384"
    restricted = start(
        "--tls-min-version=VersionTLS12", "--tls-cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"
    )
    assert _handshake(restricted, "ECDHE-ECDSA-AES256-GCM-SHA384") == "refused"
    assert _handshake(restricted, "ECDHE-ECDSA-AES128-GCM-SHA256") == "ECDHE-ECDSA-AES128-GCM-SHA256"
