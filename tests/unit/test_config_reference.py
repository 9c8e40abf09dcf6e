"""What the reference's own tests check of some of its configurations (project-corpus/ of the
reference's files under ../shared, see tests/llm_d_corpus.py, whose first line names the source in
llm-d/llm-d-router); and the ``epp check-config`` / ``epp plugins`` commands around them."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config import ConfigError, LoadedConfig, load_config_file
from tests.llm_d_corpus import EXPECTED, needs_corpus, project_config

NO_ENV: dict[str, str] = {}


def _pd(cfg: LoadedConfig) -> None:
    handler = cfg.scheduler.handler
    assert handler.type_name == "disagg-profile-handler"
    # declared before its decider, which is created first and wired in
    assert getattr(handler, "prefill_decider", None) is cfg.plugins["prefix-based-pd-decider"]
    assert list(cfg.plugins)[:8][6:] == ["disagg-profile-handler", "prefix-based-pd-decider"]


def _admitter(cfg: LoadedConfig) -> None:
    assert cfg.saturation_detector is cfg.plugins["utilization-detector"]
    assert cfg.saturation_detector.params.queue_depth_threshold == 999999999


def _gate_off(name: str) -> Callable[[LoadedConfig], None]:
    def check(cfg: LoadedConfig) -> None:
        assert name not in cfg.feature_gates

    return check


def _fc(**expected: Any) -> Callable[[LoadedConfig], None]:
    def check(cfg: LoadedConfig) -> None:
        fc = yaml.safe_load(cfg.effective_yaml())["flowControl"]
        for key, value in expected.items():
            assert fc[key] == value, (key, fc)

    return check


def _ignored(cfg: LoadedConfig) -> None:
    assert not cfg.flow_control_enabled
    assert any(w.startswith("flowControl:") and "ignored" in w for w in cfg.warnings)


def _not_ignored(cfg: LoadedConfig) -> None:
    assert not any(w.startswith("flowControl:") for w in cfg.warnings)
    assert cfg.saturation_detector is cfg.plugins["utilization-detector"]


def _no_sources(cfg: LoadedConfig) -> None:
    assert cfg.data_sources == []


def _deprecated_detector(cfg: LoadedConfig) -> None:
    assert cfg.flow_control_enabled
    assert cfg.saturation_detector is cfg.plugins["utilization-detector"]
    assert any("top-level saturationDetector is deprecated" in w for w in cfg.warnings)


LOADS: dict[str, Callable[[LoadedConfig], None]] = {
    "pd-epp-config": _pd,
    "probabilistic-admitter-epp-config": _admitter,
    "feature_gate_test-ConfigText": _gate_off("haPopulateNonLeaderDatastore"),
    "feature_gate_test-configText-3": _gate_off("flowControl"),
    "testdata_test-successFlowControlConfigText": _fc(
        maxBytes="1024", defaultRequestTTL="1m", noEndpointRequestTTL="5m"
    ),
    "testdata_test-successFlowControlInheritedTTLText": _fc(
        defaultRequestTTL="0s", noEndpointRequestTTL="0s"
    ),
    "testdata_test-successflowControlConfigDisabledText": _ignored,
    "testdata_test-successFlowControlConfigNoGatesText": _ignored,
    "testdata_test-successFlowControlDisabledSaturationDetectorText": _not_ignored,
    "testdata_test-successDataLayerOptOutText": _no_sources,
    "testdata_test-successDeprecatedTopLevelSaturationDetectorText": _deprecated_detector,
}

FAILS: dict[str, tuple[str, str]] = {
    "testdata_test-errorUnknownFeatureGateText": (
        "featureGates[0]",
        "feature gate 'unknown-gate' is unknown or unregistered",
    ),
    "testdata_test-errorBadFeatureGateText": (
        "featureGates[0]",
        "qwerty is not a valid value for the feature gate flowControl",
    ),
    "testdata_test-errorFlowControlMissingPluginText": (
        "flowControl.priorityBands[0].orderingPolicyRef",
        'no ordering policy registered for name "non-existent-policy"',
    ),
}


def _path(name: str) -> str:
    return str(project_config(name))


def test_every_named_config_is_in_the_corpus_with_that_outcome() -> None:
    expected = {k.removeprefix("project-corpus/"): v for k, v in EXPECTED.items()}
    for name in LOADS:
        assert expected[name] == "load", name
    for name, (field_path, _) in FAILS.items():
        entry = expected[name]
        assert entry.get("reject", entry.get("reject-with-mocks")) == field_path, name


@needs_corpus
@pytest.mark.parametrize("name", sorted(LOADS))
def test_reference_config_loads(name: str) -> None:
    cfg = load_config_file(_path(name), environ=NO_ENV, allow_experimental=False)
    LOADS[name](cfg)
    again = yaml.safe_load(cfg.effective_yaml())
    assert again["apiVersion"] == "llm-d.ai/v1"


@needs_corpus
@pytest.mark.parametrize("name", sorted(FAILS))
def test_reference_error_config_is_rejected(name: str) -> None:
    field_path, reason = FAILS[name]
    with pytest.raises(ConfigError) as info:
        load_config_file(_path(name), environ=NO_ENV)
    assert info.value.field == field_path
    assert reason in info.value.reason


# --- the commands ------------------------------------------------------------------------------------


def epp(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epp", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


WARNING_CONFIG = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {name: decode, type: by-label, parameters: {label: llm-d.ai/role, validValues: [decode]}}
- {type: queue-scorer}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: decode}, {pluginRef: queue-scorer}]
flowControl:
  maxRequests: 10
"""


def test_check_config_output_pipes_into_check_config(tmp_path: Path) -> None:
    """Only the effective YAML reaches stdout, even with deprecation and ignored-section warnings."""
    path = tmp_path / "f.yaml"
    path.write_text(WARNING_CONFIG)
    cmd = f"{shlex.quote(sys.executable)} -m epp check-config {shlex.quote(str(path))}"
    first = epp("check-config", str(path))
    assert first.returncode == 0, first.stderr
    assert "'by-label' is deprecated" in first.stderr and "label-selector-filter" in first.stderr
    assert "feature gate is disabled" in first.stderr
    piped = subprocess.run(
        [
            "bash",
            "-o",
            "pipefail",
            "-c",
            f"{cmd} 2>/dev/null | {shlex.quote(sys.executable)} -m epp check-config -",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert yaml.safe_load(piped.stdout) == yaml.safe_load(first.stdout)
    assert "'by-label' is deprecated" in piped.stderr  # the second run sees the same type


ALPHA_PLUGIN_MODULE = """
from epp.framework import Filter, Stability, register

@register
class Experimental(Filter):
    type_name = "test-experimental-filter"
    stability = Stability.ALPHA

    def filter(self, cycle, request, endpoints):
        return endpoints
"""


def test_check_config_refuses_alpha_types_unless_allowed(tmp_path: Path) -> None:
    (tmp_path / "alpha_plugin.py").write_text(ALPHA_PLUGIN_MODULE)
    config = tmp_path / "c.yaml"
    config.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: test-experimental-filter}]\n"
    )
    runner = "import sys, alpha_plugin; from epp.cli import main; sys.exit(main(sys.argv[1:]))"

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", runner, "check-config", *flags, str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )

    refused = run()
    assert refused.returncode == 2
    assert "plugins[0].type" in refused.stderr and "Alpha stability level" in refused.stderr
    assert "--allow-experimental-plugins" in refused.stderr
    assert refused.stdout == ""
    for flags in (("--allow-experimental-plugins",), ("--allow-experimental-plugins=true",)):
        allowed = run(*flags)
        assert allowed.returncode == 0, allowed.stderr
        assert "test-experimental-filter" in allowed.stdout


def test_serve_refuses_alpha_types_unless_allowed(tmp_path: Path) -> None:
    from epp.cli import _go_bool_flags, build_parser

    (tmp_path / "alpha_plugin.py").write_text(ALPHA_PLUGIN_MODULE)
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: test-experimental-filter}]\n"
    )
    runner = "import sys, alpha_plugin; from epp.cli import main; sys.exit(main(sys.argv[1:]))"
    refused = subprocess.run(
        [sys.executable, "-c", runner, "serve", "--config-text", text, "--pool-name", "p"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert refused.returncode == 2
    assert "Alpha stability level" in refused.stderr and "--allow-experimental-plugins" in refused.stderr
    parser = build_parser()
    args = parser.parse_args(_go_bool_flags(["serve", "--allow-experimental-plugins", "--pool-name", "p"]))
    assert args.allow_experimental_plugins is True
    assert parser.parse_args(["serve"]).allow_experimental_plugins is False


def test_plugins_lists_types_with_kinds_stability_aliases_and_defaults() -> None:
    out = epp("plugins", "--output", "json")
    assert out.returncode == 0, out.stderr
    entries = {e["type"]: e for e in json.loads(out.stdout)}
    picker = entries["max-score-picker"]
    assert picker["kinds"] == ["picker"]
    assert picker["stability"] == "beta"
    assert picker["parameters"] == {"maxNumOfEndpoints": 1}
    selector = entries["label-selector-filter"]
    assert selector["deprecatedNames"] == ["by-label", "by-label-selector"]
    assert selector["aliases"] == ["by-label-selector"]
    assert entries["by-label"]["deprecated"]["replacement"] == "label-selector-filter"
    assert entries["disagg-headers-handler"]["aliases"] == ["prefill-header-handler"]
    assert entries["disagg-profile-handler"]["deprecatedNames"] == [
        "disagg-headers-handler",
        "pd-profile-handler",
        "prefill-header-handler",
    ]
    assert "filter" in entries["utilization-detector"]["kinds"]
    assert entries["session-affinity-scorer"]["stability"] == "alpha"  # as the reference marks it
    assert "saturation-detector" in entries["utilization-detector"]["kinds"]
    text = epp("plugins")
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    start = lines.index("label-selector-filter  [filter]  beta")
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        block.append(line)
    assert "  deprecated names: by-label, by-label-selector" in block
    assert "  maxNumOfEndpoints: int = 1" in text.stdout
