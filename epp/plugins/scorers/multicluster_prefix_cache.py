"""``multicluster-prefix-cache-scorer`` (alpha): ``prefix-cache-scorer`` over peer clusters.

Over cluster endpoints the prefix index keys on the cluster, so a repeated prefix goes back to the
cluster that served it; parameters and rule are ``prefix-cache-scorer``'s.
"""

from __future__ import annotations

from epp.framework import Stability, register
from epp.plugins.scorers.prefix_cache import PrefixCacheScorer

__all__ = ["MultiClusterPrefixCacheScorer"]


@register
class MultiClusterPrefixCacheScorer(PrefixCacheScorer):
    type_name = "multicluster-prefix-cache-scorer"
    stability = Stability.ALPHA
