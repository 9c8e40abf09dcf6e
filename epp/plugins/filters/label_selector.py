"""``label-selector-filter`` (alias ``by-label-selector``): endpoints whose labels match a LabelSelector."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, register
from epp.framework.registry import deprecate

_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_OPERATOR_LIST = "one of " + ", ".join(_OPERATORS)
_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1123_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_MAX_NAME = 63
_MAX_PREFIX = 253


def _key_problem(key: object) -> str | None:
    """Why ``key`` is not a valid label key (a Kubernetes qualified name), or None."""
    if not isinstance(key, str):
        return f"label key must be a string, got {key!r}"
    parts = key.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            return f"invalid label key {key!r}: prefix part must be non-empty"
        if len(prefix) > _MAX_PREFIX or not _DNS1123_SUBDOMAIN_RE.match(prefix):
            return (
                f"invalid label key {key!r}: prefix part must be a lowercase RFC 1123 subdomain "
                f"of at most {_MAX_PREFIX} characters"
            )
    else:
        return f"invalid label key {key!r}: a qualified name has at most one '/'"
    if not name:
        return f"invalid label key {key!r}: name part must be non-empty"
    if len(name) > _MAX_NAME:
        return f"invalid label key {key!r}: name part must be no more than {_MAX_NAME} characters"
    if not _NAME_RE.match(name):
        return (
            f"invalid label key {key!r}: name part must consist of alphanumeric characters, '-', '_' "
            "or '.', and must start and end with an alphanumeric character"
        )
    return None


def _value_problem(value: object) -> str | None:
    """Why ``value`` is not a valid label value, or None."""
    if not isinstance(value, str):
        return f"label value must be a string, got {value!r}"
    if len(value) > _MAX_NAME:
        return f"invalid label value {value!r}: must be no more than {_MAX_NAME} characters"
    if not _VALUE_RE.match(value):
        return (
            f"invalid label value {value!r}: must be empty or consist of alphanumeric characters, "
            "'-', '_' or '.', and must start and end with an alphanumeric character"
        )
    return None


@dataclass(slots=True, frozen=True)
class LabelSelectorRequirement:
    """One ``matchExpressions`` entry."""

    key: str = ""
    operator: str = ""
    values: tuple[str, ...] = ()

    def validate(self) -> str | None:
        problem = _key_problem(self.key)
        if problem:
            return f"key: {problem}"
        if self.operator not in _OPERATORS:
            return f"operator: {self.operator!r} is not a valid label selector operator ({_OPERATOR_LIST})"
        if self.operator in ("In", "NotIn"):
            if not self.values:
                return "values: for 'In', 'NotIn' operators, values set can't be empty"
        elif self.values:
            return "values: values set must be empty for 'Exists' and 'DoesNotExist'"
        for i, v in enumerate(self.values):
            problem = _value_problem(v)
            if problem:
                return f"values[{i}]: {problem}"
        return None


@dataclass(slots=True, frozen=True)
class LabelSelectorParams:
    match_labels: Mapping[str, str] = field(default_factory=dict)
    match_expressions: tuple[LabelSelectorRequirement, ...] = ()

    def validate(self) -> str | None:
        for k, v in self.match_labels.items():
            problem = _key_problem(k) or _value_problem(v)
            if problem:
                return f"matchLabels.{k}: {problem}"
        return None


# A compiled requirement: (operator, key, values). matchLabels pairs become "=" requirements.
_Requirement = tuple[str, str, frozenset[str]]


def _matches(labels: Mapping[str, str], requirements: tuple[_Requirement, ...]) -> bool:
    for op, key, values in requirements:
        value = labels.get(key)
        if op == "=" or op == "In":
            if value is None or value not in values:
                return False
        elif op == "NotIn":
            if value is not None and value in values:
                return False
        elif op == "Exists":
            if value is None:
                return False
        elif value is not None:  # DoesNotExist
            return False
    return True


class LabelSelectorFilter(Filter):
    type_name = "label-selector-filter"
    Params = LabelSelectorParams
    params: LabelSelectorParams

    def __init__(self, name: str, params: LabelSelectorParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        reqs: list[_Requirement] = [("=", k, frozenset((v,))) for k, v in params.match_labels.items()]
        reqs.extend((r.operator, r.key, frozenset(r.values)) for r in params.match_expressions)
        self._requirements = tuple(reqs)

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        requirements = self._requirements
        if not requirements:
            return list(endpoints)
        return [e for e in endpoints if _matches(e.metadata.labels, requirements)]


register(LabelSelectorFilter, "by-label-selector")
deprecate("by-label-selector", LabelSelectorFilter.type_name, since="v0.9.0", removal="v0.11.0")
