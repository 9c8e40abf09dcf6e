"""The docs follow the registry: the README's plugin count and every registered type, with each of
its parameters, in docs/plugins.md's catalog table (a new type or parameter without its row fails)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from epp.config.catalog import describe

ROOT = Path(__file__).resolve().parents[2]


def _catalog_rows() -> dict[str, str]:
    """Type name (each one named in a row's first cell) -> the row's text."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text.split("\n## Catalog\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`([a-z0-9-]+)`", first):
            rows[name] = line
    return rows


def test_readme_counts_the_registered_types() -> None:
    readme = (ROOT / "README.md").read_text()
    counts = {int(n) for n in re.findall(r"(\d+) registered (?:plugin )?types", readme)}
    assert counts == {len(describe())}, "README.md's plugin-type count drifted from `epp plugins`"


@pytest.mark.parametrize("entry", describe(), ids=lambda e: e["type"])
def test_every_type_and_parameter_is_in_the_catalog_table(entry: dict) -> None:
    rows = _catalog_rows()
    assert entry["type"] in rows, f"{entry['type']} has no row in docs/plugins.md's catalog"
    row = rows[entry["type"]]
    for same in re.findall(r"\bas `([a-z0-9-]+)`", row):  # "as `other-type`": that row's parameters
        row += rows.get(same, "")
    for alias in entry["aliases"]:
        assert alias in row, f"{entry['type']}: alias {alias} missing from its catalog row"
    missing = [key for key in entry["parameters"] if key not in row]
    assert missing == [], f"{entry['type']}: parameters missing from its catalog row: {missing}"
