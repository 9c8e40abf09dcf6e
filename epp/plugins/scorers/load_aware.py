"""``load-aware-scorer``: score by waiting-queue length against a threshold."""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, register
from epp.plugins.scorers._metric_scorer import MetricScorer

DEFAULT_THRESHOLD = 128


@dataclass(slots=True, frozen=True)
class LoadAwareParams:
    threshold: int = DEFAULT_THRESHOLD

    @property
    def effective_threshold(self) -> int:
        return self.threshold if self.threshold > 0 else DEFAULT_THRESHOLD


@register
class LoadAwareScorer(MetricScorer):
    type_name = "load-aware-scorer"
    category = "Distribution"
    Params = LoadAwareParams
    params: LoadAwareParams

    def __init__(self, name: str, params: LoadAwareParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._threshold = float(params.effective_threshold)

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        t = self._threshold
        out = []
        for e in endpoints:
            q = e.metrics.waiting_queue_size
            out.append(0.5 if q == 0 else 0.5 * (1.0 - min(q, t) / t))
        return out
