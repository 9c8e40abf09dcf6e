"""docs/plugins.md's worked example: a third-party plugin found through the entry-point group."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.config import load_config
from epp.framework import CycleState, registry
from tests.unit.factories import completions, endpoint

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture
def installed_example(tmp_path: Path) -> Iterator[None]:
    """Install the doc's plugin module as a distribution declaring the doc's entry point."""
    (tmp_path / "epp_prefer_label.py").write_text(_blocks("python")[0])
    dist = tmp_path / "epp_prefer_label-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: epp-prefer-label\nVersion: 0.1\n")
    toml = _blocks("toml")[0]
    entry = re.search(r'^(prefer-label-scorer) = "(.*)"$', toml, flags=re.M)
    assert entry is not None
    (dist / "entry_points.txt").write_text(f"[epp.plugins]\n{entry.group(1)} = {entry.group(2)}\n")
    sys.path.insert(0, str(tmp_path))
    registry.load_entry_points(reload=True)
    yield
    sys.path.remove(str(tmp_path))
    sys.modules.pop("epp_prefer_label", None)


def test_example_plugin_loads_from_its_entry_point_and_steers_scheduling(installed_example: None) -> None:
    (config,) = [b for b in _blocks("yaml") if "type: prefer-label-scorer" in b]  # the example's config
    cfg = load_config(config)
    endpoints = [endpoint(f"e{i}", f"10.0.0.{i}", labels={"zone": "a" if i == 3 else "b"}) for i in range(5)]
    for _ in range(20):
        result, err = cfg.scheduler.schedule(CycleState(), completions("hello", request_id="r"), endpoints)
        assert err is None and result is not None and result.primary is not None
        assert result.primary.target_endpoints == [endpoints[3]]


def test_example_plugin_parameters_are_validated(installed_example: None) -> None:
    from epp.framework import ConfigError

    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: prefer-label-scorer}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(text)
    assert e.value.field == "plugins[0].parameters.label"


def test_every_built_in_type_is_in_the_catalog() -> None:
    text = DOC.read_text()
    missing = [t for t in registry.registered_types() if f"`{t}`" not in text]
    assert missing == []
