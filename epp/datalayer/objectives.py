"""InferenceObjective priorities, looked up per request by objective name.

The Kubernetes watcher (``epp.k8s``) hands raw objects (camelCase dicts) to ``ObjectiveStore``; the
director reads ``priority(name)`` for the ``x-gateway-inference-objective`` header.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

log = structlog.get_logger("epp.datalayer.objectives")

DEFAULT_POOL_GROUP = "inference.networking.k8s.io"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def object_name(obj: Any) -> str:
    """``metadata.name`` of a raw object, or "" when it has none (for log messages and keys)."""
    if not isinstance(obj, Mapping):
        return ""
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def is_being_deleted(obj: Mapping[str, Any]) -> bool:
    meta = obj.get("metadata")
    return isinstance(meta, Mapping) and bool(meta.get("deletionTimestamp"))


def _ref_matches(ref: Any, pool_name: str, pool_group: str, kind: str, name: str, field: str) -> bool | None:
    if not isinstance(ref, Mapping):
        log.warning(f"skipping malformed {kind}", object=name, field=field, reason="not a mapping")
        return None
    ref_name = ref.get("name")
    group = ref.get("group")
    if not isinstance(ref_name, str) or (group is not None and not isinstance(group, str)):
        bad = f"{field}.name" if not isinstance(ref_name, str) else f"{field}.group"
        log.warning(f"skipping malformed {kind}", object=name, field=bad, reason="not a string")
        return None
    return ref_name == pool_name and (group or DEFAULT_POOL_GROUP) == pool_group


def _expression_matches(expression: Any, labels: Mapping[str, str]) -> bool | None:
    if not isinstance(expression, Mapping):
        return None
    key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
    if not isinstance(key, str) or not isinstance(values, list):
        return None
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    return None


def selector_matches(selector: Any, labels: Mapping[str, str]) -> bool | None:
    """A Kubernetes label selector (``matchLabels``, ``matchExpressions``) against ``labels``; an
    empty selector matches every pool; None when malformed."""
    if not isinstance(selector, Mapping):
        return None
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not isinstance(match_labels, Mapping) or not isinstance(expressions, list):
        return None
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expression in expressions:
        matched = _expression_matches(expression, labels)
        if matched is None:
            return None
        if not matched:
            return False
    return True


def pool_ref_matches(
    spec: Mapping[str, Any],
    pool_name: str,
    pool_group: str,
    kind: str,
    name: str,
    pool_labels: Mapping[str, str] | None = None,
) -> bool | None:
    """Whether the object applies to this pool; None (after a warning) when malformed.

    ``spec.poolRef`` names one pool; ``spec.poolRefs`` (a list of such refs) and ``spec.poolSelector``
    (a label selector over the InferencePools of the object's namespace, matched against
    ``pool_labels``) name several; the object applies when any of them names this pool. None of
    them names no pool (False). ``group`` defaults to ``inference.networking.k8s.io``.
    """
    ref = spec.get("poolRef")
    refs = spec.get("poolRefs")
    selector = spec.get("poolSelector")
    matched = False
    if ref is not None:
        one = _ref_matches(ref, pool_name, pool_group, kind, name, "spec.poolRef")
        if one is None:
            return None
        matched = one
    if refs is not None:
        if not isinstance(refs, list):
            log.warning(f"skipping malformed {kind}", object=name, field="spec.poolRefs", reason="not a list")
            return None
        for i, entry in enumerate(refs):
            one = _ref_matches(entry, pool_name, pool_group, kind, name, f"spec.poolRefs[{i}]")
            if one is None:
                return None
            matched = matched or one
    if selector is not None:
        one = selector_matches(selector, pool_labels or {})
        if one is None:
            log.warning(f"skipping malformed {kind}", object=name, field="spec.poolSelector", reason="bad")
            return None
        matched = matched or one
    return matched


def _priority(spec: Mapping[str, Any], name: str) -> int | None:
    raw = spec.get("priority")
    if raw is None:
        return 0
    integral = isinstance(raw, int) or (isinstance(raw, float) and raw.is_integer())
    if isinstance(raw, bool) or not integral:
        reason = f"expected an integer, got {raw!r}"
    elif not INT32_MIN <= raw <= INT32_MAX:
        reason = f"out of the int32 range: {raw!r}"
    else:
        return int(raw)
    log.warning("skipping malformed InferenceObjective", object=name, field="spec.priority", reason=reason)
    return None


class ObjectiveStore:
    """Objective name → priority for the objectives of one InferencePool.

    An object is kept, by ``metadata.name``, while it applies to this pool (``spec.poolRef``,
    ``spec.poolRefs``, ``spec.poolSelector``: ``pool_ref_matches``); otherwise
    (another pool, marked for deletion, malformed) that name is removed, so the store never keeps a
    version the cluster no longer has. ``spec.priority`` is an optional int32 (missing → 0; negative
    means sheddable); an unknown name has priority 0. Nothing here raises.
    """

    __slots__ = ("_priorities", "pool_group", "pool_labels", "pool_name")

    def __init__(
        self,
        pool_name: str,
        pool_group: str = DEFAULT_POOL_GROUP,
        pool_labels: Mapping[str, str] | None = None,
    ) -> None:
        self.pool_name = pool_name
        self.pool_group = pool_group or DEFAULT_POOL_GROUP
        self.pool_labels: Mapping[str, str] = pool_labels or {}  # for spec.poolSelector
        self._priorities: dict[str, int] = {}

    def _parse(self, obj: Any) -> tuple[str, int | None]:
        """``(name, priority)``: priority None = not for this pool, deleted, or malformed."""
        name = object_name(obj)
        if not name:
            log.warning("skipping malformed InferenceObjective", object="", field="metadata.name")
            return "", None
        if is_being_deleted(obj):
            return name, None
        spec = obj.get("spec")
        if spec is None:
            spec = {}
        if not isinstance(spec, Mapping):
            log.warning(
                "skipping malformed InferenceObjective", object=name, field="spec", reason="not a mapping"
            )
            return name, None
        if not pool_ref_matches(
            spec, self.pool_name, self.pool_group, "InferenceObjective", name, self.pool_labels
        ):
            return name, None
        return name, _priority(spec, name)

    def upsert_object(self, obj: Mapping[str, Any]) -> None:
        """Add or update an objective; one for another pool (or malformed) deletes its name."""
        name, priority = self._parse(obj)
        if not name:
            return
        if priority is None:
            self._priorities.pop(name, None)
        else:
            self._priorities[name] = priority

    def delete(self, name: str) -> None:
        self._priorities.pop(name, None)

    def priority(self, name: str) -> int:
        """The objective's priority; 0 for an unknown (or empty) name."""
        return self._priorities.get(name, 0)

    def __contains__(self, name: object) -> bool:
        return name in self._priorities

    def __len__(self) -> int:
        return len(self._priorities)

    def snapshot(self) -> dict[str, int]:
        """A copy of name → priority (debugging, tests)."""
        return dict(self._priorities)
