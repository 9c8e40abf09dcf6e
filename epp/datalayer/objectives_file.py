"""InferenceObjective priorities from a local file (``epp serve --objectives-file``), for endpoints
without Kubernetes: a YAML document ``objectives: [{name: critical, priority: 10}, ...]`` read once
at start into the same :class:`ObjectiveStore` the Kubernetes watcher fills."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from epp.datalayer.objectives import INT32_MAX, INT32_MIN, ObjectiveStore


class ObjectivesFileError(ValueError):
    """The file cannot be used; the message names the file, the field and the reason."""


def load_objectives_file(path: str, pool_name: str) -> ObjectiveStore:
    """The objectives of ``path``; raises :class:`ObjectivesFileError` for a missing or bad file."""
    try:
        document = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ObjectivesFileError(f"{path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ObjectivesFileError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(document, Mapping) or not isinstance(document.get("objectives"), list):
        raise ObjectivesFileError(f"{path}: objectives: expected a list of {{name, priority}}")
    store = ObjectiveStore(pool_name)
    for i, entry in enumerate(document["objectives"]):
        where = f"{path}: objectives[{i}]"
        if not isinstance(entry, Mapping):
            raise ObjectivesFileError(f"{where}: expected a mapping with name and priority")
        unknown = sorted(set(entry) - {"name", "priority"})
        if unknown:
            raise ObjectivesFileError(f"{where}: unknown field {unknown[0]!r} (fields: name, priority)")
        name, priority = entry.get("name"), entry.get("priority", 0)
        if not isinstance(name, str) or not name:
            raise ObjectivesFileError(f"{where}.name: expected a non-empty string")
        if name in store:
            raise ObjectivesFileError(f"{where}.name: {name!r} is declared twice")
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not INT32_MIN <= priority <= INT32_MAX
        ):
            raise ObjectivesFileError(
                f"{where}.priority: expected an int32 (negative: sheddable), got {priority!r}"
            )
        store.upsert_object(
            {"metadata": {"name": name}, "spec": {"priority": priority, "poolRef": {"name": pool_name}}}
        )
    return store
