"""``topology-affinity-filter``: keep candidates co-located with the endpoint an earlier stage picked."""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, Stability, register
from epp.plugins.profile_handlers.disagg import PEER_ENDPOINT_KEY
from epp.plugins.scraping.topology_extractor import Topology, compare, parse_level, topology_key

__all__ = ["TopologyAffinityFilter", "TopologyAffinityFilterParams", "peer_topology"]


def peer_topology(cycle: CycleState, key: str) -> Topology | None:
    """The topology of the peer endpoint (the stage picked before), None when unknown."""
    peer = cycle.get(PEER_ENDPOINT_KEY)
    if not isinstance(peer, Endpoint):
        return None
    topo = peer.attributes.get(key)
    return topo if isinstance(topo, Topology) else None


@dataclass(slots=True, frozen=True)
class TopologyAffinityFilterParams:
    min_affinity: str = "host"
    topology_producer_name: str = ""

    def validate(self) -> str | None:
        if parse_level(self.min_affinity or "host") is None:
            return (
                f'minAffinity: invalid topology level "{self.min_affinity}", '
                "must be one of host, rack, zone, region"
            )
        return None


@register
class TopologyAffinityFilter(Filter):
    type_name = "topology-affinity-filter"
    stability = Stability.ALPHA
    Params = TopologyAffinityFilterParams
    params: TopologyAffinityFilterParams

    def __init__(self, name: str, params: TopologyAffinityFilterParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        level = parse_level(params.min_affinity or "host")
        assert level is not None  # validated
        self.min_affinity = level
        self.key = topology_key(params.topology_producer_name)

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        key = self.key
        peer = peer_topology(cycle, key)
        if peer is None:
            return list(endpoints)
        floor = self.min_affinity
        kept = []
        for e in endpoints:
            topo = e.attributes.get(key)
            if isinstance(topo, Topology) and compare(peer, topo) <= floor:
                kept.append(e)
        return kept or list(endpoints)
