"""``header-label-affinity-scorer``: prefer endpoints whose label equals a request header."""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, Stability, register

__all__ = ["HeaderLabelAffinityParams", "HeaderLabelAffinityScorer"]


@dataclass(slots=True, frozen=True)
class HeaderLabelAffinityParams:
    header_name: str = ""
    label_key: str = ""

    def validate(self) -> str | None:
        if not self.header_name:
            return "headerName: header-label-affinity-scorer headerName is required"
        if not self.label_key:
            return "labelKey: header-label-affinity-scorer labelKey is required"
        return None


@register
class HeaderLabelAffinityScorer(Scorer):
    """1.0 for endpoints whose ``labelKey`` label equals the ``headerName`` header, else 0.0."""

    type_name = "header-label-affinity-scorer"
    category = "Affinity"
    stability = Stability.ALPHA
    Params = HeaderLabelAffinityParams
    params: HeaderLabelAffinityParams

    def __init__(self, name: str, params: HeaderLabelAffinityParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.header = params.header_name.lower()
        self.label = params.label_key

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        wanted = request.headers.get(self.header, "")
        if not wanted:
            return [0.0] * len(endpoints)
        label = self.label
        return [1.0 if e.metadata.labels.get(label) == wanted else 0.0 for e in endpoints]
