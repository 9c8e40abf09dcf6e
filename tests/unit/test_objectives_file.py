"""``--objectives-file``: priorities without Kubernetes, and precise errors for a bad file."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.datalayer.objectives_file import ObjectivesFileError, load_objectives_file


def test_objectives_file_gives_priorities_by_name(tmp_path: Path) -> None:
    f = tmp_path / "objectives.yaml"
    f.write_text(
        "objectives:\n- {name: critical, priority: 10}\n- {name: batch, priority: -1}\n- {name: plain}\n"
    )
    store = load_objectives_file(str(f), "pool")
    assert store.snapshot() == {"critical": 10, "batch": -1, "plain": 0}
    assert store.priority("unknown") == 0


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("- a", "objectives: expected a list of {name, priority}"),
        ("objectives: [{name: a, priority: high}]", "objectives[0].priority: expected an int32"),
        ("objectives: [{name: a, priority: true}]", "objectives[0].priority: expected an int32"),
        ("objectives: [{name: a, priority: 4294967296}]", "objectives[0].priority: expected an int32"),
        ("objectives: [{priority: 1}]", "objectives[0].name: expected a non-empty string"),
        ("objectives: [{name: a}, {name: a}]", "objectives[1].name: 'a' is declared twice"),
        ("objectives: [{name: a, prio: 1}]", "objectives[0]: unknown field 'prio'"),
        ("objectives: [3]", "objectives[0]: expected a mapping"),
        ("objectives: [", "not valid YAML"),
    ],
)
def test_a_bad_objectives_file_names_the_field(tmp_path: Path, text: str, error: str) -> None:
    f = tmp_path / "objectives.yaml"
    f.write_text(text)
    with pytest.raises(ObjectivesFileError, match=r"objectives\.yaml") as info:
        load_objectives_file(str(f), "pool")
    assert error in str(info.value)


def test_a_missing_objectives_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ObjectivesFileError) as info:
        load_objectives_file(str(tmp_path / "nope.yaml"), "pool")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: cannot read it: No such file or directory"
