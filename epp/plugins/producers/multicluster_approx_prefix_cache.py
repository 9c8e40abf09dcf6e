"""``multicluster-approx-prefix-cache-producer`` (alpha): ``approx-prefix-cache-producer`` over peer
clusters (its index keys on the endpoint, here a cluster); same parameters."""

from __future__ import annotations

from epp.framework import Stability, register
from epp.plugins.producers.approx_prefix_cache import ApproxPrefixCacheProducer

__all__ = ["MultiClusterApproxPrefixCacheProducer"]


@register
class MultiClusterApproxPrefixCacheProducer(ApproxPrefixCacheProducer):
    type_name = "multicluster-approx-prefix-cache-producer"
    stability = Stability.ALPHA
