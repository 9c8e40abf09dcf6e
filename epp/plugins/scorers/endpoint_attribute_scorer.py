"""``endpoint-attribute-scorer``: score endpoints by a numeric endpoint attribute, linearly normalised."""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, Stability, register
from epp.framework.params import OMIT_UNSET
from epp.plugins.scorers._data_keys import as_number, endpoint_key_or_error, resolve_attribute_key

__all__ = ["EndpointAttributeScorer", "EndpointAttributeScorerParams"]

LOWER_IS_BETTER = "linear_lower_is_better"
HIGHER_IS_BETTER = "linear_higher_is_better"


@dataclass(slots=True, frozen=True)
class FixedRange:
    min: float = 0.0
    max: float = 0.0


@dataclass(slots=True, frozen=True)
class AdaptiveRange:
    pass


@dataclass(slots=True, frozen=True)
class Normalization:
    # None first: an explicit null (as in the effective configuration) means "not set"
    fixed_range: None | FixedRange = field(default=None, metadata=OMIT_UNSET)  # noqa: RUF036
    adaptive_range: None | AdaptiveRange = field(default=None, metadata=OMIT_UNSET)  # noqa: RUF036

    def validate(self) -> str | None:
        if self.fixed_range is not None and self.adaptive_range is not None:
            return "at most one normalization strategy is allowed, got both fixedRange and adaptiveRange"
        fixed = self.fixed_range
        if fixed is not None and fixed.min >= fixed.max:
            return f"fixedRange: requires min < max, got min {fixed.min}, max {fixed.max}"
        return None


@dataclass(slots=True, frozen=True)
class ScorerAlgorithmParams:
    type: str = ""
    normalization: Normalization = field(default_factory=Normalization)

    def validate(self) -> str | None:
        if self.type not in (LOWER_IS_BETTER, HIGHER_IS_BETTER):
            return f'type: must be "{LOWER_IS_BETTER}" or "{HIGHER_IS_BETTER}", got "{self.type}"'
        return None


@dataclass(slots=True, frozen=True)
class EndpointAttributeScorerParams:
    attribute_key: str = ""
    # None (left out when printed) = the core metrics extractor; "" = producer-agnostic
    producer: str | None = field(default=None, metadata=OMIT_UNSET)
    algorithm: ScorerAlgorithmParams = field(default_factory=ScorerAlgorithmParams)

    def validate(self) -> str | None:
        if not self.attribute_key:
            return "attributeKey: endpoint attribute scorer requires a non-empty attributeKey"
        problem = endpoint_key_or_error(self.attribute_key, self.producer)
        if problem:
            return f"attributeKey: {problem}"
        problem = self.algorithm.validate()
        return f"algorithm.{problem}" if problem else None


@register
class EndpointAttributeScorer(Scorer):
    type_name = "endpoint-attribute-scorer"
    category = "Distribution"
    stability = Stability.ALPHA
    Params = EndpointAttributeScorerParams
    params: EndpointAttributeScorerParams

    def __init__(
        self, name: str, params: EndpointAttributeScorerParams, handle: Handle | None = None
    ) -> None:
        super().__init__(name, params, handle)
        self.key = resolve_attribute_key(params.attribute_key, params.producer)
        self._lower = params.algorithm.type == LOWER_IS_BETTER
        self._fixed = params.algorithm.normalization.fixed_range

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        key, lower = self.key, self._lower
        values = [as_number(e.attributes.get(key)) for e in endpoints]
        fixed = self._fixed
        if fixed is not None:
            lo, span = fixed.min, fixed.max - fixed.min
        else:
            present = [v for v in values if v is not None]
            if not present:
                return [0.0] * len(endpoints)
            lo = min(present)
            span = max(present) - lo
            if span == 0:  # every endpoint with the attribute has the same value: neutral 1.0
                return [0.0 if v is None else 1.0 for v in values]
        out: list[float] = []
        append = out.append
        for v in values:
            if v is None:
                append(0.0)
                continue
            x = (v - lo) / span
            x = 0.0 if x < 0.0 else 1.0 if x > 1.0 else x
            append(1.0 - x if lower else x)
        return out
