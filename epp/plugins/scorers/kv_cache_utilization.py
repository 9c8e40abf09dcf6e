"""``kv-cache-utilization-scorer``: prefer endpoints with free KV cache.

Type: ``kv-cache-utilization-scorer`` (Distribution). Parameters: none.
Algorithm: ``score = 1 - kv_cache_usage_percent`` (a 0..1 fraction); the framework clamps to [0, 1].
"""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer, register


@register
class KVCacheUtilizationScorer(Scorer):
    type_name = "kv-cache-utilization-scorer"
    category = "Distribution"

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        return [1.0 - e.metrics.kv_cache_usage_percent for e in endpoints]
