"""The ``epp`` command line: check-config output and exit codes, serve refusing a bad config, and
serve's log level and format flags."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml


def epp(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epp", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def epp_each(argvs: Sequence[Sequence[str]]) -> list[subprocess.CompletedProcess[str]]:
    """``epp`` once per argv, a few at a time (each run is an interpreter's start-up), in order."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda argv: epp(*argv), argvs))


def test_check_config_prints_the_effective_default_profile(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("")  # no configuration at all: epp's default
    out = epp("check-config", str(cfg))
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    (profile,) = doc["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert weights["prefix-spread-scorer"] == 1
    assert "queue-scorer" not in weights and "prefix-cache-scorer" not in weights
    assert "max-score-picker" in weights
    types = {p["type"] for p in doc["plugins"]}
    assert {"single-profile-handler", "approx-prefix-cache-producer", "openai-parser"} <= types


def test_check_config_names_the_bad_field_and_fails() -> None:
    text = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
  parameters: {maxNumOfEndpoints: "two"}
"""
    out = epp("check-config", "-", stdin=text)
    assert out.returncode == 2
    assert "plugins[1].parameters.maxNumOfEndpoints" in out.stderr
    assert out.stdout == ""


def test_check_config_deprecated_api_version_warns() -> None:
    out = epp(
        "check-config",
        "-",
        stdin="apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n",
    )
    assert out.returncode == 0
    assert "warning" in out.stderr and "inference.networking.x-k8s.io/v1alpha1" in out.stderr


def test_serve_exits_non_zero_on_a_bad_config_before_serving() -> None:
    out = epp(
        "serve", "--secure-serving=false", "--config-text", "apiVersion: llm-d.ai/v1alpha1\nkind: Nope\n"
    )
    assert out.returncode == 2
    assert "kind" in out.stderr and "Nope" in out.stderr


def test_serve_rejects_both_config_sources() -> None:
    out = epp("serve", "--config-text", "a: b", "--config-file", "/nonexistent")
    assert out.returncode != 0
    assert 'both the "configText" and "configFile" flags can not be set at the same time' in out.stderr


def test_serve_fails_when_the_endpoints_file_is_unreadable(tmp_path: Path) -> None:
    text = f"""apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{name: files, type: file-discovery, parameters: {{path: {tmp_path / "missing.yaml"}}}}}
dataLayer:
  discovery: {{pluginRef: files}}
"""
    out = epp(
        "serve",
        "--secure-serving=false",
        "--grpc-port",
        "0",
        "--grpc-health-port",
        "0",
        "--metrics-port",
        "0",
        "--config-text",
        text,
    )
    assert out.returncode == 1
    assert "missing.yaml" in out.stderr


FILE_DISCOVERY = (
    "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
    "- {name: f, type: file-discovery, parameters: {path: /nonexistent}}\n"
    "dataLayer: {discovery: {pluginRef: f}}\n"
)


def test_serve_names_the_endpoint_source_problems_before_serving() -> None:
    cases = [
        ((), "either pool-name or endpoint-selector must be set"),
        (("--pool-name", "p", "--endpoint-selector", "app=x"), "either pool-name or endpoint-selector"),
        (("--endpoint-selector", "app=x"), 'flag "endpoint-target-ports" should have length from 1 to 8'),
        (
            ("--endpoint-selector", "app=x", "--endpoint-target-ports", "8000,99999"),
            'invalid port number 99999 in "endpoint-target-ports"',
        ),
        (("--endpoint-selector", "app", "--endpoint-target-ports", "8000"), "expected key=value"),
        (("--pool-name", "p", "--endpoint-target-ports", "8000"), 'only used with "endpoint-selector"'),
        (("--pool-name", "p", "--pool-namespace", ""), '"pool-namespace" must not be empty'),
        (("--pool-name", "p", "--model-server-metrics-port", "0"), 'invalid port number 0 in "model-server'),
        (("--endpoint-selector", "app!=x", "--endpoint-target-ports", "8000"), 'invalid label key "app!"'),
        (
            ("--pool-name", "p", "--ha-enable-leader-election", "--ha-renew-deadline=20s"),
            "--ha-lease-duration > --ha-renew-deadline",
        ),
    ]
    outs = epp_each([("serve", "--secure-serving=false", "--config-text", "", *args) for args, _ in cases])
    for (args, message), out in zip(cases, outs, strict=True):
        assert out.returncode != 0 and message in out.stderr, (args, out.stderr[-500:])
        assert ("file-discovery" in out.stderr) == (args == ()), out.stderr  # the way without Kubernetes
    out = epp("serve", "--config-text", FILE_DISCOVERY, "--endpoint-selector", "app=x")
    assert out.returncode != 0 and "use exactly one endpoint source" in out.stderr
    out = epp("serve", "--config-text", FILE_DISCOVERY, "--ha-enable-leader-election")
    assert out.returncode != 0 and "needs Kubernetes discovery" in out.stderr


def test_serve_without_any_cluster_configuration_says_how_to_fix_it(tmp_path: Path) -> None:
    env_file = tmp_path / "missing-kubeconfig"
    out = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--secure-serving=false", "--pool-name", "p"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(env_file)},
    )
    assert out.returncode != 0
    assert "no Kubernetes configuration" in out.stderr and "--kubeconfig" in out.stderr


def test_standalone_pool_name_comes_from_the_deployment_of_pod_name() -> None:
    from epp.cli import _standalone_pool_name

    assert _standalone_pool_name("vllm-epp-5d8f9c7b6-x2x4q") == "vllm-epp"
    assert _standalone_pool_name("epp") == "epp"
    assert _standalone_pool_name("") == "epp"


def test_serve_rejects_a_negative_fairness_id_label_limit() -> None:
    out = epp("serve", "--secure-serving=false", "--fairness-id-metric-label-limit", "-1")
    assert out.returncode != 0
    assert "fairness-id-metric-label-limit must be non-negative, got -1" in out.stderr


def test_serve_rejects_a_non_positive_metrics_staleness_threshold() -> None:
    out = epp("serve", "--secure-serving=false", "--metrics-staleness-threshold", "0s")
    assert out.returncode == 2
    assert "--metrics-staleness-threshold" in out.stderr and "must be a positive duration" in out.stderr


def test_serve_exits_when_every_entry_of_the_endpoints_file_is_invalid(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n- {name: a, address: 10.0.0.300, port: 8000}\n")
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- {{name: files, type: file-discovery, parameters: {{path: {endpoints}}}}}\n"
        "dataLayer: {discovery: {pluginRef: files}}\n"
    )
    ports = ("--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0")
    out = epp("serve", "--secure-serving=false", *ports, "--config-text", text)
    assert out.returncode == 1
    assert "none of its 1 endpoint entry is valid" in out.stderr
    assert 'endpoint \\"a\\": invalid IPv4 address' in out.stderr  # the entry, named, with its reason


def test_serve_checks_the_stream_limits() -> None:
    small = epp("serve", "--max-buffered-request-body-bytes=1000", "--max-request-body-bytes=2000")
    assert small.returncode != 0
    assert "--max-buffered-request-body-bytes=1000" in small.stderr and "(2000)" in small.stderr
    negative = epp("serve", "--request-idle-timeout=-1")
    assert negative.returncode != 0 and "--request-idle-timeout=-1.0" in negative.stderr


def test_serve_rejects_an_unknown_log_level_or_format() -> None:
    cases = [
        (("--log-level", "verbose"), "argument --log-level: unknown log level 'verbose'"),
        (("--log-format", "text"), "argument --log-format: unknown log format 'text': use json or console"),
        (("--zap-log-level", "panic"), "argument --zap-log-level: unknown zap log level 'panic'"),
        (("--zap-log-level", "0"), "argument --zap-log-level: unknown zap log level '0'"),
        (("--zap-encoder", "xml"), "argument --zap-encoder: unknown log format 'xml'"),
        (("--v", "-1"), "must be a non-negative integer, got '-1'"),
    ]
    outs = epp_each([("serve", "--secure-serving=false", "--pool-name", "p", *args) for args, _ in cases])
    for (args, message), out in zip(cases, outs, strict=True):
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr[-500:])
    assert "use debug, info, warning (or warn) or error" in epp("serve", "--log-level", "x").stderr
    env = {**os.environ, "EPP_LOG_LEVEL": "loud"}
    out = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--pool-name", "p"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "EPP_LOG_LEVEL: unknown log level 'loud'" in out.stderr


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ((), None, ("info", "json")),
        (("--log-level", "WARN"), None, ("warning", "json")),
        (("--log-level", "debug", "--zap-log-level", "error"), None, ("debug", "json")),
        (("--zap-log-level", "debug"), None, ("info", "json")),  # zap debug is verbosity 1: info lines
        (("--zap-log-level", "warn"), None, ("warning", "json")),
        (("--zap-log-level", "error"), None, ("error", "json")),
        (("--zap-log-level", "3"), None, ("info", "json")),
        (("--zap-log-level", "4"), None, ("debug", "json")),
        (("--zap-log-level", "error", "--v", "5"), None, ("error", "json")),
        (("--v", "2"), None, ("info", "json")),
        (("--v=4",), None, ("debug", "json")),
        (("-v", "5"), None, ("debug", "json")),
        ((), "error", ("error", "json")),
        ((), "", ("info", "json")),
        (("--v", "4"), "error", ("debug", "json")),
        (("--zap-encoder", "console"), None, ("info", "console")),
        (("--log-format", "json", "--zap-encoder", "console"), None, ("info", "json")),
        (("--log-format", "Console"), None, ("info", "console")),
    ],
)
def test_serve_log_flags_map_to_a_level_and_a_format(
    monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...],
    env: str | None,
    expected: tuple[str, str],
) -> None:
    from epp.cli import _log_settings, build_parser

    if env is None:
        monkeypatch.delenv("EPP_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("EPP_LOG_LEVEL", env)
    assert _log_settings(build_parser().parse_args(["serve", *flags])) == expected


def _failing_serve(tmp_path: Path, *flags: str) -> list[str]:
    """Run a serve that logs its readiness (info) and then fails (error) with stderr on a terminal;
    its stderr lines."""
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- {{name: files, type: file-discovery, parameters: {{path: {tmp_path / 'missing.yaml'}}}}}\n"
        "dataLayer: {discovery: {pluginRef: files}}\n"
    )
    ports = ("--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0")
    argv = [sys.executable, "-m", "epp", "serve", "--secure-serving=false", *ports, "--config-text", text]
    env = {k: v for k, v in os.environ.items() if k != "EPP_LOG_LEVEL"}
    master, slave = pty.openpty()
    with subprocess.Popen([*argv, *flags], stdout=subprocess.DEVNULL, stderr=slave, env=env) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=60) == 1
    os.close(master)
    return [line for line in b"".join(chunks).decode().splitlines() if line.strip()]


def test_serve_logs_json_lines_by_default_even_on_a_terminal(tmp_path: Path) -> None:
    lines = _failing_serve(tmp_path)
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(events) == len(lines), lines  # nothing but JSON objects
    assert any(e["event"] == "readiness" and e["level"] == "info" for e in events)
    (failed,) = [e for e in events if e["event"] == "epp failed"]
    assert failed["level"] == "error" and "missing.yaml" in failed["error"]


def test_serve_log_format_console_and_error_level(tmp_path: Path) -> None:
    for flags in (("--log-format", "console", "--log-level", "error"), ("--zap-encoder=console", "--v=2")):
        lines = _failing_serve(tmp_path, *flags)
        assert not any(line.startswith("{") for line in lines), lines
        assert any("[error" in line and "epp failed" in line for line in lines), lines
        readiness = [line for line in lines if "readiness" in line]
        if "--log-level" in flags:
            assert readiness == [], lines  # info lines are below the error level
        else:
            assert readiness and "[info" in readiness[0], lines


DISAGG_WITHOUT_DECIDERS = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: disagg-profile-handler
- type: max-score-picker
- type: queue-scorer
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: max-score-picker}, {pluginRef: queue-scorer}]
- name: decode
  plugins: [{pluginRef: max-score-picker}, {pluginRef: queue-scorer}]
"""


def test_check_config_writes_only_the_effective_config_to_stdout() -> None:
    from epp.config import load_config

    out = epp("check-config", "-", stdin=DISAGG_WITHOUT_DECIDERS)
    assert out.returncode == 0, out.stderr
    expected = yaml.safe_load(load_config(DISAGG_WITHOUT_DECIDERS, source="-").effective_yaml())
    assert yaml.safe_load(out.stdout) == expected
    assert "disagg-profile-handler" in {p["type"] for p in expected["plugins"]}
    assert "No deciders.prefill configured" in out.stderr  # the plugin's log line, on stderr
    assert "warning" in out.stderr and "inference.networking.x-k8s.io/v1alpha1" in out.stderr


def test_run_sim_arg_takes_a_flag_as_its_value_with_or_without_equals() -> None:
    from epp.cli import _go_bool_flags, _pass_through_values, build_parser

    argv = ["run", "--sim-arg", "--max-num-seqs=2", "--sim-arg=--time-scale=0.5", "--sims", "2"]
    args = build_parser().parse_args(_go_bool_flags(_pass_through_values(argv)))
    assert args.sim_arg == ["--max-num-seqs=2", "--time-scale=0.5"]
    assert args.sims == 2
    # a trailing --sim-arg with no value is still argparse's own error
    assert _pass_through_values(["run", "--sim-arg"]) == ["run", "--sim-arg"]
