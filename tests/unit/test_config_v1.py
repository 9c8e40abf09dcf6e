"""``apiVersion: llm-d.ai/v1`` beside v1alpha1, router v0.11's removals and flags, and planning a
config reload (``--watch-config-file``) against the running config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epp.config import ConfigError, load_config
from epp.flowcontrol import settings_from_spec
from epp.framework import registry
from epp.server.config_reload import ReloadRefused, plan_reload

NO_ENV: dict[str, str] = {}
V1 = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"
V1ALPHA1 = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def v1(body: str, **kw: object) -> object:
    return load_config(V1 + body, environ=NO_ENV, **kw)  # type: ignore[arg-type]


def error(text: str, **kw: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(text, environ=NO_ENV, **kw)  # type: ignore[arg-type]
    return info.value


# --- the v1 layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field_path"),
    [
        ("parser: {pluginRef: openai-parser}\n", "parser"),
        ("saturationDetector: {pluginRef: utilization-detector}\n", "saturationDetector"),
        ("dataLayer: {discovery: {pluginRef: files}}\n", "dataLayer.discovery.pluginRef"),
        ("dataLayer: {peerDiscovery: {pluginRef: p}}\n", "dataLayer.peerDiscovery"),
        ("dataLayer: {crossReplicaSyncInterval: 1s}\n", "dataLayer.crossReplicaSyncInterval"),
        ("dataLayer: {crossReplica: {interval: 1s}}\n", "dataLayer.crossReplica.interval"),
    ],
)
def test_v1_refuses_the_v1alpha1_only_fields(body: str, field_path: str) -> None:
    err = error(V1 + body)
    assert err.field == field_path
    assert "unknown field" in err.reason


def test_v1alpha1_accepts_the_v1_discovery_form_and_the_explicit_one_wins() -> None:
    text = (
        "plugins:\n- {name: a, type: file-discovery, parameters: {path: /tmp/a.yaml}}\n"
        "- {name: b, type: file-discovery, parameters: {path: /tmp/b.yaml}}\n"
        "dataLayer: {discovery: {pluginRef: a, endpoints: {pluginRef: b}}}\n"
    )
    cfg = load_config(V1ALPHA1 + text, environ=NO_ENV)
    assert cfg.discovery is cfg.plugins["b"]


def test_errors_of_v1_fields_name_the_v1_path() -> None:
    err = error(V1 + "dataLayer: {discovery: {endpoints: {pluginRef: ghost}}}\n")
    assert err.field == "dataLayer.discovery.endpoints.pluginRef"
    err = error(V1 + "dataLayer: {crossReplica: {publishTimeout: soon}}\n")
    assert err.field == "dataLayer.crossReplica.publishTimeout" and "invalid duration" in err.reason


def test_a_per_band_ttl_overrides_the_global_one_and_is_rendered() -> None:
    cfg = v1(
        "featureGates: [flowControl]\n"
        "flowControl:\n  defaultRequestTTL: 30s\n"
        "  priorityBands: [{priority: 5, defaultRequestTTL: 2s}, {priority: 1}]\n"
    )
    settings = settings_from_spec(cfg.document.flow_control, cfg.plugins)  # type: ignore[attr-defined]
    assert settings.request_ttl == 30.0
    assert settings.band(5).request_ttl == 2.0 and settings.band(1).request_ttl is None
    bands = yaml.safe_load(cfg.effective_yaml())["flowControl"]["priorityBands"]  # type: ignore[attr-defined]
    assert bands[0]["defaultRequestTTL"] == "2s" and "defaultRequestTTL" not in bands[1]
    err = error(
        V1 + "featureGates: [flowControl]\nflowControl: {priorityBands: [{defaultRequestTTL: -1s}]}\n"
    )
    assert err.field == "flowControl.priorityBands[0].defaultRequestTTL"


def test_band_selection_policy_is_strict_priority_order_only() -> None:
    gate = "featureGates: [flowControl]\n"
    cfg = v1(gate + "flowControl: {bandSelectionPolicyPluginRef: strict-band-selection-policy}\n")
    fc = yaml.safe_load(cfg.effective_yaml())["flowControl"]  # type: ignore[attr-defined]
    assert fc["bandSelectionPolicyPluginRef"] == "strict-band-selection-policy"
    err = error(V1 + gate + "flowControl: {bandSelectionPolicyPluginRef: weighted}\n")
    assert err.field == "flowControl.bandSelectionPolicyPluginRef" and "strict priority order" in err.reason


def test_propagate_priority_is_read_and_kept() -> None:
    cfg = v1("requestHandler: {propagatePriority: true}\n")
    assert cfg.document.request_handler.propagate_priority is True  # type: ignore[attr-defined]
    err = error(V1 + "requestHandler: {propagatePriority: maybe}\n")
    assert err.field == "requestHandler.propagatePriority"


def test_v1_logs_no_deprecation_and_v1alpha1_exactly_one() -> None:
    new = v1("")
    old = load_config(V1ALPHA1, environ=NO_ENV)
    assert not [w for w in new.warnings if "deprecated" in w]  # type: ignore[attr-defined]
    assert len([w for w in old.warnings if "deprecated" in w]) == 1
    assert new.effective_yaml() == old.effective_yaml()  # type: ignore[attr-defined]


def test_check_config_prints_v1_or_v1alpha1(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        V1ALPHA1 + "plugins: [{name: s, type: redis-syncer}]\n"
        "dataLayer: {crossReplicaSyncerPluginRef: s, crossReplicaPublishTimeout: 2s}\n"
    )
    run = [sys.executable, "-m", "epp", "check-config", str(path)]
    new = yaml.safe_load(subprocess.run(run, capture_output=True, text=True, timeout=60, check=True).stdout)
    assert new["apiVersion"] == "llm-d.ai/v1"
    assert new["dataLayer"]["crossReplica"] == {"syncerPluginRef": "s", "publishTimeout": "2s"}
    out = subprocess.run(
        [*run, "--output", "v1alpha1"], capture_output=True, text=True, timeout=60, check=True
    )
    old = yaml.safe_load(out.stdout)
    assert old["apiVersion"] == "llm-d.ai/v1alpha1"
    assert old["dataLayer"]["crossReplicaPublishTimeout"] == "2s" and "crossReplica" not in old["dataLayer"]
    missing = subprocess.run(
        [*run[:-1], str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: config file {tmp_path / 'nope.yaml'} does not exist"


def test_a_missing_api_version_says_so() -> None:
    err = error("kind: EndpointPickerConfig\n")
    assert err.reason.startswith("apiVersion missing")


# --- router v0.11 -------------------------------------------------------------------------------------

PRECISE = (
    "plugins:\n- type: precise-prefix-cache-scorer\n"
    "  parameters: {tokenProcessorConfig: {blockSizeTokens: 16}}\n- {type: max-score-picker}\n"
    "- {type: endpoint-notification-source}\n"
    "dataLayer:\n  sources:\n  - {pluginRef: endpoint-notification-source, "
    "extractors: [{pluginRef: precise-prefix-cache-scorer}]}\n"
    "schedulingProfiles:\n- name: default\n  plugins:\n"
    "  - {pluginRef: precise-prefix-cache-scorer, weight: 3}\n"
    "  - {pluginRef: max-score-picker}\n"
)


def test_precise_prefix_cache_scorer_loads_as_its_v011_replacement_with_one_warning() -> None:
    cfg = v1(PRECISE)
    scorer = cfg.plugins["precise-prefix-cache-scorer"]  # type: ignore[attr-defined]
    producer = cfg.plugins["precise-prefix-cache-producer"]  # type: ignore[attr-defined]
    assert scorer.type_name == "prefix-cache-scorer"
    assert scorer.params.prefix_match_info_producer_name == "precise-prefix-cache-producer"
    assert producer.params.token_processor_config.block_size_tokens == 16
    sources = [(s.name, [e.name for e in x]) for s, x in cfg.data_sources]  # type: ignore[attr-defined]
    assert ("endpoint-notification-source", ["precise-prefix-cache-producer"]) in sources
    (warning,) = [w for w in cfg.warnings if "precise-prefix-cache-scorer" in w]  # type: ignore[attr-defined]
    assert "removed in router v0.11.0" in warning and "prefixMatchInfoProducerName" in warning


@pytest.mark.parametrize(
    ("body", "field_path", "reason"),
    [
        (PRECISE, "plugins[0].type", "plugin type 'precise-prefix-cache-scorer' is not registered"),
        (
            "plugins: [{type: by-label, parameters: {label: x}}]\n",
            "plugins[0].type",
            "'label-selector-filter'",
        ),
        ("plugins: [{type: tokenizer}]\n", "plugins[0].type", "use 'token-producer'"),
        (
            "plugins:\n- {type: max-score-picker}\n- {type: disagg-profile-handler, "
            "parameters: {decodeProfile: d}}\n"
            "schedulingProfiles:\n- {name: d, plugins: [{pluginRef: max-score-picker}]}\n",
            "plugins[1].parameters.decodeProfile",
            "decodeProfile -> profiles.decode",
        ),
    ],
)
def test_compat_v011_refuses_what_v011_removed(body: str, field_path: str, reason: str) -> None:
    err = error(V1 + body, compat_version="v0.11")
    assert err.field == field_path
    assert reason in err.reason and "removed in router v0.11.0" in err.reason


_PD_PROFILES = (
    "- {type: max-score-picker}\nschedulingProfiles:\n"
    "- {name: prefill, plugins: [{pluginRef: max-score-picker}]}\n"
    "- {name: decode, plugins: [{pluginRef: max-score-picker}]}\n"
)
REMOVED_SAMPLES = {
    "tokenizer": ("plugins:\n- {type: tokenizer}\n", "'token-producer'"),
    "by-label": (
        "plugins:\n- {type: by-label, parameters: {label: x, validValues: [a]}}\n",
        "'label-selector-filter'",
    ),
    "by-label-selector": (
        "plugins:\n- {type: by-label-selector, parameters: {matchLabels: {a: b}}}\n",
        "'label-selector-filter'",
    ),
    "disagg-headers-handler": ("plugins:\n- {type: disagg-headers-handler}\n", "'disagg-profile-handler'"),
    "prefill-header-handler": ("plugins:\n- {type: prefill-header-handler}\n", "'disagg-profile-handler'"),
    "pd-profile-handler": (
        "plugins:\n- {type: pd-profile-handler}\n- {type: prefix-based-pd-decider}\n" + _PD_PROFILES,
        "'disagg-profile-handler'",
    ),
}


@pytest.mark.parametrize("removed", sorted(REMOVED_SAMPLES))
def test_every_removed_type_loads_with_one_warning_and_is_refused_for_v011(removed: str) -> None:
    body, replacement = REMOVED_SAMPLES[removed]
    registry._WARNED.discard(removed)  # deprecated names warn once per process
    cfg = load_config(V1ALPHA1 + body, environ=NO_ENV)
    (warning,) = [w for w in cfg.warnings if f"'{removed}'" in w]
    assert warning.startswith("plugins[0].type: ") and "removed in router v0.11.0" in warning
    assert replacement in warning
    err = error(V1ALPHA1 + body, compat_version="v0.11")
    assert err.field == "plugins[0].type"
    assert err.reason.startswith(f"plugin type '{removed}' is not registered")  # v0.11's own words
    assert replacement in err.reason


def test_the_samples_cover_every_removed_type() -> None:
    from epp.config.removed import PRECISE_SCORER, REMOVED_TYPES

    assert set(REMOVED_SAMPLES) | {PRECISE_SCORER} == set(REMOVED_TYPES)


def test_flat_disagg_parameters_warn_naming_the_nested_form() -> None:
    cfg = v1(
        "plugins:\n- {type: max-score-picker}\n"
        "- {type: disagg-profile-handler, parameters: {decodeProfile: d}}\n"
        "schedulingProfiles:\n- {name: d, plugins: [{pluginRef: max-score-picker}]}\n"
    )
    assert any("decodeProfile -> profiles.decode" in w for w in cfg.warnings)  # type: ignore[attr-defined]


def test_feature_gates_flag_overrides_the_config() -> None:
    cfg = v1("featureGates: [flowControl]\n", feature_gates={"flowControl": False})
    assert not cfg.flow_control_enabled  # type: ignore[attr-defined]
    assert v1("", feature_gates={"flowControl": True}).flow_control_enabled  # type: ignore[attr-defined]
    err = error(V1, feature_gates={"flowContrl": True})
    assert err.field == "--feature-gates" and 'did you mean "flowControl"' in err.reason


def test_check_config_applies_the_feature_gates_flag_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(V1 + "featureGates: [flowControl]\n")
    run = [sys.executable, "-m", "epp", "check-config"]

    def gates(*flags: str) -> list[str]:
        out = subprocess.run([*run, *flags, str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return list(yaml.safe_load(out.stdout)["featureGates"])

    assert "flowControl" in gates()
    assert "flowControl" not in gates("--feature-gates", "flowControl=false")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grpc-port", "70000"], "out of range 0-65535"),
        (["--metrics-port", "-1"], "out of range 0-65535"),
        (["--grpc-health-port", "65536"], "out of range 0-65535"),
        (["--ha-replication-port", "70000"], "out of range 0-65535"),
        (["--model-server-metrics-port", "65536"], "out of range 0-65535"),
        (["--grpc-port", "9x"], "not an integer"),
        (
            ["--endpoint-selector", "app=x", "--endpoint-target-ports", "8000,70000"],
            'invalid port number 70000 in "endpoint-target-ports"',
        ),
        (["--feature-gates", "flowControl=maybe"], "invalid value of feature gate flowControl"),
        (["--plugin-state-staleness-threshold", "0s"], "must be positive"),
    ],
)
def test_serve_flags_of_v011_are_validated(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--secure-serving=false", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr


# --- planning a reload --------------------------------------------------------------------------------

BASE = (
    "featureGates: [flowControl]\n"
    "plugins:\n- {name: group, type: label-selector-filter, parameters: {matchLabels: {group: a}}}\n"
    "- {type: queue-scorer}\n- {type: max-score-picker}\n- {type: approx-prefix-cache-producer}\n"
    "schedulingProfiles:\n- name: default\n"
    "  plugins: [{pluginRef: group}, {pluginRef: queue-scorer, weight: 1}, "
    "{pluginRef: max-score-picker}]\n"
    "flowControl: {priorityBands: [{priority: 1, maxRequests: 10}]}\n"
)


def test_a_reload_reuses_unchanged_plugins_and_takes_new_parameters_and_bands() -> None:
    running = v1(BASE)
    edited = (
        BASE.replace("group: a", "group: b")
        .replace("weight: 1", "weight: 4")
        .replace("maxRequests: 10", "maxRequests: 3")
    )
    candidate = v1(edited)
    plan = plan_reload(running, candidate)  # type: ignore[arg-type]
    (profile,) = plan.scheduler.profiles.values()
    assert profile.scorers[0].scorer is running.plugins["queue-scorer"]  # type: ignore[attr-defined]
    assert profile.scorers[0].weight == 4
    assert profile.filters[0] is candidate.plugins["group"]  # type: ignore[attr-defined]
    assert profile.picker is running.plugins["max-score-picker"]  # type: ignore[attr-defined]
    assert plan.plugins["approx-prefix-cache-producer"] is running.plugins["approx-prefix-cache-producer"]  # type: ignore[attr-defined]
    assert plan.flow_settings is not None and plan.flow_settings.band(1).max_requests == 3


@pytest.mark.parametrize(
    ("edit", "field_path", "reason"),
    [
        (
            ("featureGates: [flowControl]", "featureGates: []"),
            "featureGates",
            "cannot change without a restart",
        ),
        (
            (
                "- {type: max-score-picker}\n",
                "- {type: max-score-picker}\n- {type: kv-cache-utilization-scorer}\n",
            ),
            "plugins",
            "added ['kv-cache-utilization-scorer']",
        ),
        (
            (
                "- {type: approx-prefix-cache-producer}",
                "- {type: approx-prefix-cache-producer, parameters: {blockSizeTokens: 32}}",
            ),
            "plugins",
            "'approx-prefix-cache-producer'",
        ),
        (
            ("flowControl: {", "dataLayer: {injectDefaults: false}\nflowControl: {"),
            "dataLayer",
            "dataLayer cannot change",
        ),
    ],
)
def test_a_reload_refuses_what_cannot_change_live_naming_it(
    edit: tuple[str, str], field_path: str, reason: str
) -> None:
    running = v1(BASE)
    text = BASE.replace(*edit)
    assert text != BASE
    with pytest.raises(ReloadRefused) as info:
        plan_reload(running, v1(text))  # type: ignore[arg-type]
    assert info.value.field == field_path
    assert reason in info.value.reason
