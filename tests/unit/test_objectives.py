"""``ObjectiveStore``: InferenceObjective objects → priority by name, for this pool only."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from epp.datalayer.objectives import ObjectiveStore

POOL = "my-pool"


def objective(
    name: str,
    priority: Any = None,
    *,
    pool: str = POOL,
    group: str | None = None,
    with_priority: bool = True,
    **meta: Any,
) -> dict[str, Any]:
    ref: dict[str, Any] = {"kind": "InferencePool", "name": pool}
    if group is not None:
        ref["group"] = group
    spec: dict[str, Any] = {"poolRef": ref}
    if with_priority:
        spec["priority"] = priority
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": "default", **meta},
        "spec": spec,
    }


@pytest.fixture
def store() -> ObjectiveStore:
    return ObjectiveStore(pool_name=POOL, pool_group="inference.networking.k8s.io")


def test_priority_by_name_and_unknown_names_are_zero(store: ObjectiveStore) -> None:
    store.upsert_object(objective("critical", 10))
    store.upsert_object(objective("batch", -1))
    assert store.priority("critical") == 10
    assert store.priority("batch") == -1
    assert store.priority("unknown") == 0
    assert store.priority("") == 0
    assert len(store) == 2


@pytest.mark.parametrize("kwargs", [{"priority": None}, {"with_priority": False}])
def test_missing_or_null_priority_is_zero_but_stored(store: ObjectiveStore, kwargs: dict[str, Any]) -> None:
    store.upsert_object(objective("plain", **kwargs))
    assert "plain" in store
    assert store.priority("plain") == 0


def test_update_replaces_the_priority(store: ObjectiveStore) -> None:
    store.upsert_object(objective("o", 5))
    store.upsert_object(objective("o", -3))
    assert store.priority("o") == -3


@pytest.mark.parametrize(
    ("group", "stored"),
    [
        (None, True),  # poolRef.group defaults to inference.networking.k8s.io
        ("", True),
        ("inference.networking.k8s.io", True),
        ("inference.networking.x-k8s.io", False),
    ],
)
def test_pool_group_must_match(store: ObjectiveStore, group: str | None, stored: bool) -> None:
    store.upsert_object(objective("o", 7, group=group))
    assert ("o" in store) is stored
    assert store.priority("o") == (7 if stored else 0)


def test_custom_pool_group() -> None:
    store = ObjectiveStore(pool_name=POOL, pool_group="example.com")
    store.upsert_object(objective("default-group", 1))
    store.upsert_object(objective("custom", 2, group="example.com"))
    assert store.snapshot() == {"custom": 2}


def test_moving_to_another_pool_deletes_the_name(store: ObjectiveStore) -> None:
    store.upsert_object(objective("o", -1))
    store.upsert_object(objective("o", -1, pool="other-pool"))
    assert "o" not in store
    assert store.priority("o") == 0


def test_no_pool_ref_is_not_for_this_pool(store: ObjectiveStore) -> None:
    store.upsert_object(objective("o", 3))
    store.upsert_object({"metadata": {"name": "o"}, "spec": {"priority": 3}})
    assert "o" not in store


def test_marked_for_deletion_is_deleted(store: ObjectiveStore) -> None:
    store.upsert_object(objective("o", 3))
    store.upsert_object(objective("o", 3, deletionTimestamp="2025-01-01T00:00:00Z"))
    assert "o" not in store


def test_delete(store: ObjectiveStore) -> None:
    store.upsert_object(objective("a", 1))
    store.upsert_object(objective("b", 2))
    store.delete("a")
    store.delete("never-there")
    assert store.snapshot() == {"b": 2}


def test_updates_other_pools_and_bad_objects(store: ObjectiveStore) -> None:
    store.upsert_object(objective("kept", 1))
    for obj in (
        objective("kept", 4),
        objective("new", -2),
        objective("elsewhere", 9, pool="other-pool"),
        objective("bad", "high"),
    ):
        store.upsert_object(obj)
    assert store.snapshot() == {"kept": 4, "new": -2}


def test_integral_float_priority_is_accepted(store: ObjectiveStore) -> None:
    store.upsert_object(objective("o", 3.0))
    assert store.priority("o") == 3


@pytest.mark.parametrize(
    ("priority", "reason"),
    [
        ("high", "expected an integer"),
        (1.5, "expected an integer"),
        (True, "expected an integer"),
        (2**31, "out of the int32 range"),
        (-(2**31) - 1, "out of the int32 range"),
    ],
)
def test_malformed_priority_is_skipped_with_a_warning_and_drops_the_old_version(
    store: ObjectiveStore, priority: Any, reason: str
) -> None:
    store.upsert_object(objective("o", -1))
    with capture_logs() as logs:
        store.upsert_object(objective("o", priority))
    assert "o" not in store
    (entry,) = [e for e in logs if e["log_level"] == "warning"]
    assert entry["object"] == "o"
    assert entry["field"] == "spec.priority"
    assert reason in entry["reason"]


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"metadata": {}, "spec": {}}, "metadata.name"),
        ({"spec": {"priority": 1}}, "metadata.name"),
        ("not an object", "metadata.name"),
        ({"metadata": {"name": "o"}, "spec": []}, "spec"),
        ({"metadata": {"name": "o"}, "spec": {"poolRef": "my-pool"}}, "spec.poolRef"),
        ({"metadata": {"name": "o"}, "spec": {"poolRef": {"name": 3}}}, "spec.poolRef.name"),
        ({"metadata": {"name": "o"}, "spec": {"poolRef": {"name": POOL, "group": 1}}}, "spec.poolRef.group"),
    ],
)
def test_malformed_objects_never_raise(store: ObjectiveStore, obj: Any, field: str) -> None:
    store.upsert_object(objective("o", 2))
    with capture_logs() as logs:
        store.upsert_object(obj)
        store.upsert_object(objective("p", 1))
    # a bad object removes its earlier good version, unless it has no name to find it by
    assert store.snapshot() == ({"o": 2, "p": 1} if field == "metadata.name" else {"p": 1})
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert warnings and all(e["field"] == field for e in warnings)
