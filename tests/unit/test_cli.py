"""The ``epp`` command line: check-config output and exit codes, serve refusing a bad config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def epp(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epp", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def test_check_config_prints_the_effective_default_profile(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("")  # no configuration at all: the reference's default
    out = epp("check-config", str(cfg))
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    (profile,) = doc["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert weights["queue-scorer"] == 2 and weights["kv-cache-utilization-scorer"] == 2
    assert weights["prefix-cache-scorer"] == 3
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
