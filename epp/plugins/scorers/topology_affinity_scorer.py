"""``topology-affinity-scorer``: prefer candidates close to the endpoint an earlier stage picked."""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, Stability, register
from epp.plugins.filters.topology_affinity_filter import peer_topology
from epp.plugins.scraping.topology_extractor import Level, Topology, compare, topology_key

__all__ = ["LEVEL_SCORES", "TopologyAffinityScorer", "TopologyAffinityScorerParams"]

LEVEL_SCORES: dict[Level, float] = {
    Level.HOST: 1.00,
    Level.RACK: 0.20,
    Level.ZONE: 0.05,
    Level.REGION: 0.02,
    Level.NONE: 0.00,
}


@dataclass(slots=True, frozen=True)
class TopologyAffinityScorerParams:
    topology_producer_name: str = ""


@register
class TopologyAffinityScorer(Scorer):
    type_name = "topology-affinity-scorer"
    category = "Affinity"
    stability = Stability.ALPHA
    Params = TopologyAffinityScorerParams
    params: TopologyAffinityScorerParams

    def __init__(self, name: str, params: TopologyAffinityScorerParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.key = topology_key(params.topology_producer_name)

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        key = self.key
        peer = peer_topology(cycle, key)
        if peer is None:
            return [0.0] * len(endpoints)
        out = []
        for e in endpoints:
            topo = e.attributes.get(key)
            out.append(LEVEL_SCORES[compare(peer, topo)] if isinstance(topo, Topology) else 0.0)
        return out
