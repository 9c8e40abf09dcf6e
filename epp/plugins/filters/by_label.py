"""``by-label`` (deprecated): keep endpoints whose value of one label is in a set.

Type: ``by-label``. Prefer ``label-selector-filter`` for generic label filtering and the role
filters (``decode-filter``, ``prefill-filter``, ``encode-filter``) for roles.

Parameters:

* ``label`` (string, required): the label key;
* ``validValues`` (list of strings, default empty): accepted values;
* ``allowsNoLabel`` (bool, default false): keep endpoints that do not carry the label.

Validation (the reference's messages): an empty ``label``, or an empty ``validValues`` while
``allowsNoLabel`` is false, is a configuration error.

Algorithm: keep an endpoint if its label value is in ``validValues``, or if the label is absent and
``allowsNoLabel`` is true. As in the reference, an absent label reads as the empty string, so
``validValues: [""]`` also keeps unlabelled endpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, register

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
