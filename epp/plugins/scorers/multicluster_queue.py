"""``multicluster-queue-scorer`` (alpha): prefer peer clusters with shorter average queues.

``queue-scorer``'s min-max rule over ``llm-d.ai/multicluster-queue-size`` (the cluster pool's average).
"""

from __future__ import annotations

from epp.framework import register
from epp.framework.endpoint_attributes import MULTICLUSTER_QUEUE_SIZE_KEY
from epp.plugins.scorers._cluster_attribute import ClusterAttributeScorer
from epp.plugins.scorers.queue import min_max_scores

__all__ = ["MultiClusterQueueScorer"]


@register
class MultiClusterQueueScorer(ClusterAttributeScorer):
    type_name = "multicluster-queue-scorer"
    attribute = MULTICLUSTER_QUEUE_SIZE_KEY

    def rule(self, values: list[float]) -> list[float]:
        return min_max_scores(values)
