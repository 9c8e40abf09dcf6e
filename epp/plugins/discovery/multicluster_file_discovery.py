"""``multicluster-file-discovery`` (alpha): peer clusters from a file, each one endpoint.

``file-discovery`` with cluster addresses: an address may be a DNS name or an IP of either family
(a cluster is reached through its gateway host), and the labels ``metricsAddress`` /
``metricsPort`` (default: the endpoint's port) say where the cluster's EPP metrics are scraped.
"""

from __future__ import annotations

from epp.framework import Stability, register
from epp.plugins.discovery.file_discovery import FileDiscovery

__all__ = ["MultiClusterFileDiscovery"]


@register
class MultiClusterFileDiscovery(FileDiscovery):
    type_name = "multicluster-file-discovery"
    stability = Stability.ALPHA
    hostnames = True
