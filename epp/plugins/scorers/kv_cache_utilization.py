"""``kv-cache-utilization-scorer``: prefer endpoints with free KV cache.

Type: ``kv-cache-utilization-scorer`` (Distribution). Parameters: none.
Algorithm: ``score = 1 - kv_cache_usage_percent`` (a 0..1 fraction); the framework clamps to [0, 1].
An endpoint with unknown metrics (never scraped or stale: its 0 % is not real) gets the neutral
score, the mean of the known endpoints' scores (``_metric_scorer``).
"""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, LLMRequest, register
from epp.plugins.scorers._metric_scorer import MetricScorer


@register
class KVCacheUtilizationScorer(MetricScorer):
    type_name = "kv-cache-utilization-scorer"
    category = "Distribution"

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        return [1.0 - e.metrics.kv_cache_usage_percent for e in endpoints]
