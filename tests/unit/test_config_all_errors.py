"""Loading reports every independent error of a configuration in one run, each with its field path,
the first one as the single ``ConfigError`` it always was; an error that only follows from another
(a reference to a plugin that failed to load) is not reported again. ``epp check-config`` and
``epp serve`` print them all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from epp.config import ConfigError, ConfigErrors, load_config

NO_ENV: dict[str, str] = {}

THREE_ERRORS = """apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: queue-scorrer
- name: prefix
  type: prefix-cache-scorer
  parameters:
    blockSizeTokenz: 16
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorrer
  - pluginRef: prefix
  - pluginRef: kv-cache
  - pluginRef: max-score-picker
"""

# (field, a piece of the reason) of each error of THREE_ERRORS, in order.
THREE_FIELDS = [
    ("plugins[0].type", "plugin type 'queue-scorrer' is not registered"),
    ("plugins[1].parameters.blockSizeTokenz", "unknown parameter"),
    ("schedulingProfiles[0].plugins[2].pluginRef", "references undefined plugin 'kv-cache'"),
]


def _errors(text: str) -> list[ConfigError]:
    with pytest.raises(ConfigError) as info:
        load_config(text, environ=NO_ENV)
    e = info.value
    return list(e.errors) if isinstance(e, ConfigErrors) else [e]


def test_every_independent_error_is_reported_in_order() -> None:
    errors = _errors(THREE_ERRORS)
    assert [e.field for e in errors] == [f for f, _ in THREE_FIELDS]
    for e, (_, reason) in zip(errors, THREE_FIELDS, strict=True):
        assert reason in e.reason
    # The references to the two plugins that failed are not reported again.
    assert not any("'queue-scorrer'" in e.reason and "schedulingProfiles" in e.field for e in errors)
    assert not any("'prefix'" in e.reason for e in errors)


def test_the_raised_error_carries_the_first_field_and_reason() -> None:
    with pytest.raises(ConfigErrors) as info:
        load_config(THREE_ERRORS, environ=NO_ENV)
    e = info.value
    assert e.field == "plugins[0].type"
    assert e.reason == info.value.errors[0].reason
    assert len(str(e).splitlines()) == 3


def test_a_single_error_is_raised_as_itself() -> None:
    text = THREE_ERRORS.replace("queue-scorrer", "queue-scorer").replace("Tokenz", "Tokens")
    errors = _errors(text)
    assert [e.field for e in errors] == ["schedulingProfiles[0].plugins[2].pluginRef"]
    with pytest.raises(ConfigError) as info:
        load_config(text, environ=NO_ENV)
    assert not isinstance(info.value, ConfigErrors)


def test_a_plugin_depending_on_a_failed_plugin_reports_the_root_cause_once() -> None:
    # The scorer asks for its producer (declared after it, so created on demand) which fails:
    # one error, the producer's; neither the scorer nor its profile entry adds another.
    text = """apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: prod}
- name: prod
  type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: many}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
"""
    errors = _errors(text)
    assert len(errors) == 1, errors
    assert errors[0].field == "plugins[1].parameters.blockSizeTokens"


def test_a_failed_profile_handler_is_not_reported_as_missing() -> None:
    text = """apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: disagg-profile-handler
  parameters: {nope: 1}
- type: max-score-picker
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: max-score-picker}]
"""
    errors = _errors(text)
    assert [e.field for e in errors] == ["plugins[0].parameters.nope"]


def test_document_errors_and_plugin_errors_are_reported_together() -> None:
    text = """apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
bogus: 1
featureGates: [noSuchGate]
plugins:
- type: max-score-picker
  parameters: 5
- type: metrics-data-source
  parameters: {interval: banana}
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: max-score-picker
  - pluginRef: queue-scorer
    weight: abc
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
  discovery:
    endpoints: {pluginRef: nothere}
"""
    fields = [e.field for e in _errors(text)]
    assert fields == [
        "bogus",
        "plugins[0].parameters",
        "schedulingProfiles[0].plugins[1].weight",
        "featureGates[0]",
        "plugins[1].parameters.interval",
        "dataLayer.discovery.endpoints.pluginRef",
    ]


def test_a_failed_data_source_is_not_reported_again_by_its_data_layer_entry() -> None:
    text = """apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- name: src
  type: metrics-data-source
  parameters: {scheme: gopher}
- type: core-metrics-extractor
dataLayer:
  sources:
  - pluginRef: src
    extractors: [{pluginRef: core-metrics-extractor}]
"""
    errors = _errors(text)
    assert [e.field for e in errors] == ["plugins[0].parameters.scheme"], errors


def _epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epp", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_check_config_prints_every_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(THREE_ERRORS)
    out = _epp("check-config", str(path))
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert f"invalid configuration {path}: 3 errors" in out.stderr
    for field, reason in THREE_FIELDS:
        assert any(
            line.strip().startswith(f"{field}: ") and reason in line for line in out.stderr.splitlines()
        )


def test_serve_lists_every_error_before_serving() -> None:
    out = _epp("serve", "--secure-serving=false", "--config-text", THREE_ERRORS)
    assert out.returncode == 2
    for field, _ in THREE_FIELDS:
        assert field in out.stderr
