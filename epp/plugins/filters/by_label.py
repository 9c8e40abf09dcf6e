"""``by-label`` (deprecated): keep endpoints whose value of one label is in a set."""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, register
from epp.framework.registry import deprecate

_INVALID = "invalid configuration for 'by-label' filter: "
_NEED_VALUES = "either 'validValues' must be non-empty or 'allowsNoLabel' must be true"


@dataclass(slots=True, frozen=True)
class ByLabelParams:
    label: str = ""
    valid_values: tuple[str, ...] = ()
    allows_no_label: bool = False

    def validate(self) -> str | None:
        if not self.label:
            return f"label: {_INVALID}'label' must be specified"
        if not self.valid_values and not self.allows_no_label:
            return f"validValues: {_INVALID}{_NEED_VALUES}"
        return None


@register
class ByLabelFilter(Filter):
    type_name = "by-label"
    Params = ByLabelParams
    params: ByLabelParams

    def __init__(self, name: str, params: ByLabelParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._label = params.label
        self._valid = frozenset(params.valid_values)
        self._allows_no_label = params.allows_no_label

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        label, valid, allows_no_label = self._label, self._valid, self._allows_no_label
        out = []
        for e in endpoints:
            value = e.metadata.labels.get(label)
            if (value is None and allows_no_label) or (value if value is not None else "") in valid:
                out.append(e)
        return out


deprecate(ByLabelFilter.type_name, "label-selector-filter", since="v0.9.0", removal="v0.11.0")
