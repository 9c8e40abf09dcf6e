"""``multicluster-session-affinity-filter`` (alpha): ``session-affinity-filter`` over peer clusters.

Cluster identity comes from discovery, so it pins a session to its cluster; same parameters.
"""

from __future__ import annotations

from epp.framework import Stability, register
from epp.plugins.filters.session_affinity_filter import SessionAffinityFilter

__all__ = ["MultiClusterSessionAffinityFilter"]


@register
class MultiClusterSessionAffinityFilter(SessionAffinityFilter):
    type_name = "multicluster-session-affinity-filter"
    stability = Stability.ALPHA
