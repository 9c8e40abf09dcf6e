"""``kv-cache-utilization-scorer``: prefer endpoints with free KV cache."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, sub

from epp.framework import CycleState, Endpoint, LLMRequest, register
from epp.framework.score_column import ScoreColumn
from epp.plugins.scorers._metric_scorer import ComplementColumn, MetricScorer

_KV_USAGE = attrgetter("metrics.kv_cache_usage_percent")


@register
class KVCacheUtilizationScorer(MetricScorer):
    type_name = "kv-cache-utilization-scorer"
    category = "Distribution"
    metrics_only = True

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        return list(map(sub, repeat(1.0, len(endpoints)), map(_KV_USAGE, endpoints)))  # 1 - usage, in C

    def score_column(self, endpoints: list[Endpoint]) -> ScoreColumn | None:
        return ComplementColumn(_KV_USAGE, endpoints) if self.scores_as(KVCacheUtilizationScorer) else None
