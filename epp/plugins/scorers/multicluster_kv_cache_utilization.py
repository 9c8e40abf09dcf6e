"""``multicluster-kv-cache-utilization-scorer`` (alpha): prefer peer clusters with free KV cache.

Scores ``1 - llm-d.ai/multicluster-kv-cache-utilization`` (the cluster pool's average).
"""

from __future__ import annotations

from epp.framework import register
from epp.framework.endpoint_attributes import MULTICLUSTER_KV_CACHE_UTILIZATION_KEY
from epp.plugins.scorers._cluster_attribute import ClusterAttributeScorer

__all__ = ["MultiClusterKVCacheUtilizationScorer"]


@register
class MultiClusterKVCacheUtilizationScorer(ClusterAttributeScorer):
    type_name = "multicluster-kv-cache-utilization-scorer"
    attribute = MULTICLUSTER_KV_CACHE_UTILIZATION_KEY

    def rule(self, values: list[float]) -> list[float]:
        return [1.0 - v for v in values]
