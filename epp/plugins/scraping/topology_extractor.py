"""``topology-extractor``: an endpoint's locality (host, rack, zone, region) from its labels.

Writes ``Endpoint.attributes["Topology/<extractor name>"]`` (a ``Topology``) when the endpoint is
added and whenever its labels change (the server calls ``extract_metadata``; endpoint lifecycle
events through ``extract_endpoint`` work too); read by ``topology-affinity-filter`` and
``topology-affinity-scorer``. This module also holds the level comparison they share.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from epp.framework import Endpoint, Extractor, Handle, Stability, register

__all__ = [
    "TOPOLOGY_ATTRIBUTE",
    "Level",
    "Topology",
    "TopologyExtractor",
    "TopologyExtractorParams",
    "compare",
    "parse_level",
    "topology_key",
]

TOPOLOGY_ATTRIBUTE = "Topology"
TOPOLOGY_EXTRACTOR = "topology-extractor"


def topology_key(producer_name: str) -> str:
    """The attribute key written by the extractor named ``producer_name`` (empty = the type name)."""
    return f"{TOPOLOGY_ATTRIBUTE}/{producer_name or TOPOLOGY_EXTRACTOR}"


@dataclass(slots=True, frozen=True)
class Topology:
    """Where an endpoint runs; an empty field is unknown."""

    hostname: str = ""
    rack: str = ""
    zone: str = ""
    region: str = ""


class Level(enum.IntEnum):
    """The tightest locality two endpoints share (lower is closer)."""

    HOST = 0
    RACK = 1
    ZONE = 2
    REGION = 3
    NONE = 4


_LEVEL_NAMES = {"host": Level.HOST, "rack": Level.RACK, "zone": Level.ZONE, "region": Level.REGION}


def parse_level(name: str) -> Level | None:
    return _LEVEL_NAMES.get(name)


def compare(peer: Topology, candidate: Topology) -> Level:
    """The first level, tightest first, at which both have the same non-empty value."""
    if peer.hostname and peer.hostname == candidate.hostname:
        return Level.HOST
    if peer.rack and peer.rack == candidate.rack:
        return Level.RACK
    if peer.zone and peer.zone == candidate.zone:
        return Level.ZONE
    if peer.region and peer.region == candidate.region:
        return Level.REGION
    return Level.NONE


@dataclass(slots=True, frozen=True)
class TopologyExtractorParams:
    """The label keys read (empty = the default)."""

    hostname: str = "kubernetes.io/hostname"
    rack: str = "topology.kubernetes.io/rack"
    zone: str = "topology.kubernetes.io/zone"
    region: str = "topology.kubernetes.io/region"


_DEFAULTS = TopologyExtractorParams()


@register
class TopologyExtractor(Extractor):
    type_name = TOPOLOGY_EXTRACTOR
    stability = Stability.ALPHA
    accepts: ClassVar[str] = "endpoint-events"  # what it reads when wired under a data source
    Params = TopologyExtractorParams
    params: TopologyExtractorParams

    def __init__(self, name: str, params: TopologyExtractorParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.key = topology_key(name)
        self._labels = (
            params.hostname or _DEFAULTS.hostname,
            params.rack or _DEFAULTS.rack,
            params.zone or _DEFAULTS.zone,
            params.region or _DEFAULTS.region,
        )

    def extract_endpoint(self, event: Any) -> None:
        """The same from an endpoint lifecycle event (``.type``, ``.endpoint``), as delivered by an
        endpoint-notification source; a ``Delete`` event drops the attribute."""
        endpoint = getattr(event, "endpoint", None)
        if not isinstance(endpoint, Endpoint):
            return
        if str(getattr(event, "type", "")) == "Delete":
            endpoint.attributes.pop(self.key, None)
        else:
            self.extract_metadata(endpoint)

    def extract_metadata(self, endpoint: Endpoint) -> None:
        labels = endpoint.metadata.labels
        host, rack, zone, region = (labels.get(k, "") for k in self._labels)
        if host or rack or zone or region:
            endpoint.attributes[self.key] = Topology(host, rack, zone, region)
        else:
            endpoint.attributes.pop(self.key, None)
