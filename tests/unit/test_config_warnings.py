"""Warnings for configurations that load but do not do what the user meant: an endpoints file that is
not there, a precise prefix producer whose token producer only estimates token ids, a filter, scorer
or picker no profile names, a data source no ``dataLayer.sources`` entry names. Each names its field
path; none stops the configuration from loading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from epp.config import load_config

NO_ENV: dict[str, str] = {}
HEAD = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"


def _warnings(text: str) -> list[str]:
    return load_config(text, environ=NO_ENV, allow_experimental=True).warnings


def _discovery(type_name: str, path: Path) -> str:
    return HEAD + (
        f"plugins:\n- type: {type_name}\n  parameters: {{path: '{path}'}}\n"
        f"dataLayer:\n  discovery:\n    endpoints: {{pluginRef: {type_name}}}\n"
    )


def test_a_missing_endpoints_file_is_a_warning_naming_its_field(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    for type_name in ("file-discovery", "multicluster-file-discovery"):
        found = [w for w in _warnings(_discovery(type_name, missing)) if "does not exist" in w]
        assert len(found) == 1, found
        assert found[0].startswith("plugins[0].parameters.path: ")
        assert str(missing) in found[0]


def test_an_existing_endpoints_file_gives_no_warning(tmp_path: Path) -> None:
    present = tmp_path / "endpoints.yaml"
    present.write_text("endpoints: []\n")
    assert not [w for w in _warnings(_discovery("file-discovery", present)) if "does not exist" in w]


PRECISE = (
    HEAD
    + """plugins:
- type: precise-prefix-cache-producer
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}]
"""
)


def test_precise_producer_with_an_estimating_token_producer_warns() -> None:
    # No token producer declared: the one created for it estimates token ids.
    found = [w for w in _warnings(PRECISE) if "only estimates token ids" in w]
    assert len(found) == 1, found
    assert found[0].startswith("plugins[0]: plugin 'precise-prefix-cache-producer'")
    declared = PRECISE.replace("plugins:\n", "plugins:\n- type: token-producer\n", 1)
    assert [w for w in _warnings(declared) if "only estimates token ids" in w]


def test_precise_producer_with_a_tokenizer_gives_no_warning() -> None:
    text = PRECISE.replace(
        "plugins:\n", "plugins:\n- type: token-producer\n  parameters: {local: {path: epp-bpe-8k}}\n", 1
    )
    assert not [w for w in _warnings(text) if "estimates token ids" in w]


def test_a_scorer_in_no_profile_warns() -> None:
    text = (
        HEAD
        + """plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""
    )
    found = [w for w in _warnings(text) if "in no scheduling profile" in w]
    assert found == [
        "plugins[1]: plugin 'kv-cache-utilization-scorer' (kv-cache-utilization-scorer) is in no "
        "scheduling profile and does nothing; reference it from a profile's plugins (pluginRef) or "
        "remove it"
    ]


def test_plugins_used_outside_profiles_do_not_warn() -> None:
    # The implicit profile takes every scorer; a saturation detector (a filter) tunes admission.
    text = HEAD + "plugins:\n- type: queue-scorer\n- type: utilization-detector\n"
    assert not [w for w in _warnings(text) if "in no scheduling profile" in w]


def test_a_data_source_in_no_data_layer_entry_warns() -> None:
    text = HEAD + "plugins:\n- name: models\n  type: models-data-source\n"
    found = [w for w in _warnings(text) if "never runs" in w]
    assert len(found) == 1 and found[0].startswith("plugins[0]: plugin 'models' (models-data-source)")
    wired = text + "dataLayer:\n  sources:\n  - pluginRef: models\n    extractors: [{pluginRef: x}]\n"
    wired = wired.replace("plugins:\n", "plugins:\n- name: x\n  type: models-data-extractor\n", 1)
    assert not [w for w in _warnings(wired) if "never runs" in w]


def test_check_config_prints_warnings_on_stderr_and_succeeds(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(_discovery("file-discovery", tmp_path / "nope.yaml"))
    out = subprocess.run(
        [sys.executable, "-m", "epp", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "warning: plugins[0].parameters.path: " in out.stderr
    assert "does not exist" not in out.stdout


def test_a_lone_removed_precise_scorer_schedules_in_the_implicit_profile() -> None:
    # The removed type is loaded as a prefix-cache-scorer: a file with no profile gets the implicit
    # profile of its own scorers (not the default profile, where that scorer would do nothing).
    cfg = load_config(HEAD + "plugins:\n- type: precise-prefix-cache-scorer\n", environ=NO_ENV)
    scorers = [w.scorer.name for w in cfg.scheduler.profiles["default"].scorers]
    assert scorers == ["precise-prefix-cache-scorer"]
    assert not [w for w in cfg.warnings if "in no scheduling profile" in w]
