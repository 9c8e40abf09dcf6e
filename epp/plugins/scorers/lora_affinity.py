"""``lora-affinity-scorer``: prefer endpoints that already serve (or can load) the LoRA adapter.

Type: ``lora-affinity-scorer`` (Affinity). Parameters: none.
Algorithm: the adapter is the request's target model. Per endpoint, first match wins:

1. the adapter is in ``active_models`` → 1.0;
2. ``len(active_models) + len(waiting_models) < max_active_models`` (room to load one more) → 0.8;
3. the adapter is in ``waiting_models`` → 0.6;
4. otherwise → 0.0.

Capacity is checked before "waiting", as in the reference. The adapter lists come from the
scraped metrics: an endpoint whose metrics are unknown scores neutrally (``_metric_scorer``).
"""

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
