"""``endpoint-attribute-filter``: keep endpoints whose numeric attribute passes a threshold."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, Stability, register
from epp.framework.params import OMIT_UNSET
from epp.plugins.scorers._data_keys import endpoint_key_or_error, read_scalar, resolve_attribute_key

__all__ = ["EndpointAttributeFilter", "EndpointAttributeFilterParams"]

_OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "LessThan": operator.lt,
    "LessThanOrEqual": operator.le,
    "GreaterThan": operator.gt,
    "GreaterThanOrEqual": operator.ge,
    "Equal": operator.eq,
    "NotEqual": operator.ne,
}
_ON_MISSING = ("Pass", "Fail")


@dataclass(slots=True, frozen=True)
class ThresholdParams:
    operator: str = ""
    value: float = 0.0

    def validate(self) -> str | None:
        if self.operator not in _OPERATORS:
            known = ", ".join(f'"{o}"' for o in _OPERATORS)
            return f'operator: must be one of {known}, got "{self.operator}"'
        return None


@dataclass(slots=True, frozen=True)
class FilterAlgorithmParams:
    type: str = ""
    threshold: ThresholdParams = field(default_factory=ThresholdParams)

    def validate(self) -> str | None:
        if self.type != "threshold":
            return f'type: must be "threshold", got "{self.type}"'
        if not self.threshold.operator:
            return 'threshold: required when algorithm.type is "threshold" (with an operator)'
        problem = self.threshold.validate()
        return f"threshold.{problem}" if problem else None


@dataclass(slots=True, frozen=True)
class EndpointAttributeFilterParams:
    attribute: str = ""
    # None (left out when printed) = the core metrics extractor; "" = producer-agnostic
    producer: str | None = field(default=None, metadata=OMIT_UNSET)
    on_missing: str = "Pass"
    fallback_on_empty: bool = False
    algorithm: FilterAlgorithmParams = field(default_factory=FilterAlgorithmParams)

    def validate(self) -> str | None:
        if not self.attribute:
            return "attribute: endpoint attribute filter requires a non-empty attribute"
        problem = endpoint_key_or_error(self.attribute, self.producer)
        if problem:
            return f"attribute: {problem}"
        if self.on_missing not in _ON_MISSING:
            return f'onMissing: must be "Pass" or "Fail", got "{self.on_missing}"'
        problem = self.algorithm.validate()
        return f"algorithm.{problem}" if problem else None


@register
class EndpointAttributeFilter(Filter):
    type_name = "endpoint-attribute-filter"
    stability = Stability.ALPHA
    Params = EndpointAttributeFilterParams
    params: EndpointAttributeFilterParams

    def __init__(
        self, name: str, params: EndpointAttributeFilterParams, handle: Handle | None = None
    ) -> None:
        super().__init__(name, params, handle)
        self.key = resolve_attribute_key(params.attribute, params.producer)
        threshold = params.algorithm.threshold
        self._compare = _OPERATORS[threshold.operator]
        self._value = threshold.value
        self._pass_missing = params.on_missing == "Pass"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        key, compare, threshold, pass_missing = self.key, self._compare, self._value, self._pass_missing
        kept: list[Endpoint] = []
        for e in endpoints:
            value = read_scalar(e, key)
            if value is None:
                if pass_missing:
                    kept.append(e)
            elif compare(value, threshold):
                kept.append(e)
        if not kept and self.params.fallback_on_empty:
            return list(endpoints)
        return kept
