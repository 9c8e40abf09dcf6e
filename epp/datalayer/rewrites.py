"""InferenceModelRewrite rules: which model a request is really sent to.

The Kubernetes watcher (``epp.k8s``) hands raw objects (camelCase dicts) to ``RewriteStore``; the
director calls ``choose(incoming_model, rng)`` per request.
"""

from __future__ import annotations

import bisect
import datetime as dt
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from epp import labels
from epp.datalayer.objectives import (
    DEFAULT_POOL_GROUP,
    INT32_MAX,
    is_being_deleted,
    object_name,
    pool_ref_matches,
)

log = structlog.get_logger("epp.datalayer.rewrites")

KIND = "InferenceModelRewrite"
EXACT = "Exact"


@dataclass(slots=True, frozen=True)
class RewriteRule:
    """One rule's targets, ready for weighted choice."""

    object_name: str  # the InferenceModelRewrite it came from (metric label)
    targets: tuple[str, ...]
    cumulative: tuple[int, ...]  # running sums of the weights, same length as targets
    total: int

    def pick(self, rng: random.Random) -> str | None:
        """A target by weight (uniform when every weight is 0); None without targets.

        A uniform draw in ``[0, sum of weights)`` walks the cumulative weights; a missing weight
        counts 0, so unweighted targets mixed with weighted ones are never chosen.
        """
        targets = self.targets
        if not targets:
            return None
        if self.total <= 0:
            return targets[rng.randrange(len(targets))]
        return targets[bisect.bisect_right(self.cumulative, rng.randrange(self.total))]


@dataclass(slots=True, frozen=True)
class _ParsedRule:
    models: tuple[str, ...]  # exact-match models; empty with generic=True
    generic: bool
    rule: RewriteRule


@dataclass(slots=True, frozen=True)
class _ParsedRewrite:
    name: str
    created: float  # seconds since the epoch; -inf when missing (Go's zero time sorts first)
    rules: tuple[_ParsedRule, ...]


class _Malformed(Exception):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _list(value: Any, field: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Malformed(field, f"expected a list, got {type(value).__name__}")
    return value


def _mapping(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _Malformed(field, f"expected a mapping, got {type(value).__name__}")
    return value


def _created(obj: Mapping[str, Any]) -> float:
    meta = obj.get("metadata")
    raw = meta.get("creationTimestamp") if isinstance(meta, Mapping) else None
    if raw is None or raw == "":
        return -math.inf
    if isinstance(raw, dt.datetime):
        stamp = raw
    elif isinstance(raw, str):
        try:
            stamp = dt.datetime.fromisoformat(raw)
        except ValueError:
            raise _Malformed("metadata.creationTimestamp", f"not an RFC 3339 time: {raw!r}") from None
    else:
        raise _Malformed("metadata.creationTimestamp", f"expected a string, got {type(raw).__name__}")
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return stamp.timestamp()


def _weight(target: Mapping[str, Any], field: str) -> int | None:
    raw = target.get("weight")
    if raw is None:
        return None
    if (
        isinstance(raw, bool)
        or not isinstance(raw, int | float)
        or (isinstance(raw, float) and not raw.is_integer())
    ):
        raise _Malformed(field, f"expected an integer, got {raw!r}")
    if not 0 <= raw <= INT32_MAX:
        raise _Malformed(field, f"must be between 0 and {INT32_MAX}, got {raw!r}")
    return int(raw)


def _parse_rule(name: str, rule_raw: Any, where: str) -> _ParsedRule:
    rule = _mapping(rule_raw, where)
    matches = _list(rule.get("matches"), f"{where}.matches")
    models: list[str] = []
    for j, match_raw in enumerate(matches):
        mwhere = f"{where}.matches[{j}]"
        match = _mapping(match_raw, mwhere)
        model_raw = match.get("model")
        if model_raw is None:
            continue  # matches nothing, as in the reference
        model = _mapping(model_raw, f"{mwhere}.model")
        kind = model.get("type")
        if kind is None or kind == "":
            kind = EXACT
        if not isinstance(kind, str):
            raise _Malformed(f"{mwhere}.model.type", f"expected a string, got {kind!r}")
        if kind != EXACT:
            log.warning(
                f"ignoring {KIND} match of an unsupported type",
                object=name,
                field=f"{mwhere}.model.type",
                type=kind,
            )
            continue
        value = model.get("value")
        if not isinstance(value, str):
            raise _Malformed(f"{mwhere}.model.value", f"expected a string, got {value!r}")
        if value not in models:
            models.append(value)
    targets_raw = _list(rule.get("targets"), f"{where}.targets")
    targets: list[str] = []
    weights: list[int | None] = []
    for k, target_raw in enumerate(targets_raw):
        twhere = f"{where}.targets[{k}]"
        target = _mapping(target_raw, twhere)
        model_name = target.get("modelRewrite")
        if not isinstance(model_name, str) or not model_name:
            raise _Malformed(f"{twhere}.modelRewrite", f"expected a non-empty string, got {model_name!r}")
        targets.append(model_name)
        weights.append(_weight(target, f"{twhere}.weight"))
    if not targets:
        log.warning(
            f"{KIND} rule has no targets; requests it matches are not rewritten",
            object=name,
            field=f"{where}.targets",
        )
    elif any(w is None for w in weights) and any(w is not None for w in weights):
        log.warning(
            f"{KIND} rule mixes weighted and unweighted targets; unweighted targets are never chosen",
            object=name,
            field=f"{where}.targets",
        )
    cumulative: list[int] = []
    total = 0
    for w in weights:
        total += w or 0
        cumulative.append(total)
    compiled = RewriteRule(name, tuple(targets), tuple(cumulative), total)
    return _ParsedRule(tuple(models), generic=not matches, rule=compiled)


def _parse_rewrite(obj: Mapping[str, Any], name: str) -> _ParsedRewrite:
    created = _created(obj)
    spec = _mapping(obj.get("spec") or {}, "spec")
    rules = tuple(
        _parse_rule(name, raw, f"spec.rules[{i}]")
        for i, raw in enumerate(_list(spec.get("rules"), "spec.rules"))
    )
    return _ParsedRewrite(name, created, rules)


_Index = tuple[dict[str, RewriteRule], RewriteRule | None]


def _build_index(objects: Iterable[_ParsedRewrite]) -> _Index:
    """Exact model → winning rule, and the winning generic rule (oldest object, first rule)."""
    exact: dict[str, RewriteRule] = {}
    generic: RewriteRule | None = None
    for obj in sorted(objects, key=lambda o: (o.created, o.name)):
        for parsed in obj.rules:
            if parsed.generic:
                if generic is None:
                    generic = parsed.rule
                continue
            for model in parsed.models:
                exact.setdefault(model, parsed.rule)
    return exact, generic


class RewriteStore:
    """The InferenceModelRewrite objects of one InferencePool, indexed by incoming model.

    Precedence: a rule with an exact match on the model beats generic rules (no ``matches``); among
    several, the oldest object wins (``creationTimestamp``, then the object name); within an object
    the first matching rule wins. A match without ``model`` matches nothing; a match type other than
    ``Exact`` is ignored with a warning. A winning rule without targets means no rewrite (and still
    shadows lower-precedence rules). Malformed objects are skipped with a warning naming the field,
    and any earlier version of that name is dropped; nothing here raises.

    Every change rebuilds the index (exact model → winning rule, plus the winning generic rule) and
    swaps it in as one reference; ``choose`` is a dict lookup plus one random draw and a bisection.
    """

    __slots__ = ("_index", "_objects", "pool_group", "pool_labels", "pool_name")

    def __init__(
        self,
        pool_name: str,
        pool_group: str = DEFAULT_POOL_GROUP,
        pool_labels: Mapping[str, str] | None = None,
    ) -> None:
        self.pool_name = pool_name
        self.pool_group = pool_group or DEFAULT_POOL_GROUP
        self.pool_labels: Mapping[str, str] = pool_labels or {}  # for spec.poolSelector
        self._objects: dict[str, _ParsedRewrite] = {}
        self._index: _Index = ({}, None)

    def _parse(self, obj: Any) -> tuple[str, _ParsedRewrite | None]:
        """``(name, parsed)``: parsed None = not for this pool, being deleted, or malformed."""
        name = object_name(obj)
        if not name:
            log.warning(f"skipping malformed {KIND}", object="", field="metadata.name")
            return "", None
        if is_being_deleted(obj):
            return name, None
        spec = obj.get("spec") or {}
        if not isinstance(spec, Mapping):
            log.warning(f"skipping malformed {KIND}", object=name, field="spec", reason="not a mapping")
            return name, None
        if not pool_ref_matches(spec, self.pool_name, self.pool_group, KIND, name, self.pool_labels):
            return name, None
        try:
            return name, _parse_rewrite(obj, name)
        except _Malformed as e:
            log.warning(f"skipping malformed {KIND}", object=name, field=e.field, reason=e.reason)
            return name, None

    def _reindex(self) -> None:
        self._index = _build_index(self._objects.values())
        labels.MODEL_NAMES.pin(self.configured_models())

    def upsert_object(self, obj: Mapping[str, Any]) -> None:
        """Add or update a rewrite; one for another pool (or malformed) deletes its name."""
        name, parsed = self._parse(obj)
        if not name:
            return
        if parsed is None:
            if self._objects.pop(name, None) is not None:
                self._reindex()
            return
        self._objects[name] = parsed
        self._reindex()

    def delete(self, name: str) -> None:
        if self._objects.pop(name, None) is not None:
            self._reindex()

    def rule_for(self, model: str) -> RewriteRule | None:
        """The rule that applies to ``model`` (exact beats generic), or None."""
        exact, generic = self._index
        rule = exact.get(model)
        return generic if rule is None else rule

    def choose(self, model: str, rng: random.Random) -> tuple[str, str] | None:
        """``(target model, rewrite object name)`` for an incoming model, or None: no rewrite.

        None also when the winning rule has no targets: the model then stays as sent.
        """
        rule = self.rule_for(model)
        if rule is None:
            return None
        target = rule.pick(rng)
        if target is None:
            return None
        return target, rule.object_name

    def configured_models(self) -> set[str]:
        """Every model the rules name: exact-match sources and rewrite targets."""
        exact, generic = self._index
        models = set(exact)
        for rule in (*exact.values(), *((generic,) if generic is not None else ())):
            models.update(rule.targets)
        return models

    def __len__(self) -> int:
        return len(self._objects)

    def names(self) -> list[str]:
        return sorted(self._objects)
