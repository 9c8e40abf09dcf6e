"""``lora-affinity-scorer``: prefer endpoints that already serve (or can load) the LoRA adapter."""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, LLMRequest, register
from epp.plugins.scorers._metric_scorer import MetricScorer


@register
class LoraAffinityScorer(MetricScorer):
    type_name = "lora-affinity-scorer"
    category = "Affinity"

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        model = request.target_model
        out = []
        for e in endpoints:
            m = e.metrics
            if model in m.active_models:
                out.append(1.0)
            elif len(m.active_models) + len(m.waiting_models) < m.max_active_models:
                out.append(0.8)
            elif model in m.waiting_models:
                out.append(0.6)
            else:
                out.append(0.0)
        return out
