"""``kv-cache-utilization-scorer``: prefer endpoints with free KV cache."""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, LLMRequest, register
from epp.plugins.scorers._metric_scorer import MetricScorer


@register
class KVCacheUtilizationScorer(MetricScorer):
    type_name = "kv-cache-utilization-scorer"
    category = "Distribution"
    metrics_only = True

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        return [1.0 - e.metrics.kv_cache_usage_percent for e in endpoints]
