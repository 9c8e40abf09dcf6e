"""``slo-headroom-tier-filter``: keep the endpoints predicted to meet the request's SLOs.

Splits the candidates by ``LatencyPredictionInfo`` headroom into a non-negative tier and a negative
tier, and keeps one tier: the non-negative one, except with probability ``epsilonExploreNeg``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, register
from epp.framework.attributes import LATENCY_PREDICTION_INFO_KEY, LatencyPredictionInfo
from epp.plugins.scorers._data_keys import check_producers

__all__ = ["SloHeadroomTierFilter", "SloHeadroomTierParams"]


@dataclass(slots=True, frozen=True)
class SloHeadroomTierParams:
    epsilon_explore_neg: float = 0.01
    latency_prediction_info_producer_name: str = ""

    def validate(self) -> str | None:
        if not 0.0 <= self.epsilon_explore_neg <= 1.0:
            return f"epsilonExploreNeg: must be in [0, 1], got {self.epsilon_explore_neg:g}"
        return None


@register
class SloHeadroomTierFilter(Filter):
    """Positive tier: both headrooms >= 0. Endpoints without a prediction join the negative tier;
    with no prediction at all (or one candidate) every endpoint is kept."""

    type_name = "slo-headroom-tier-filter"
    Params = SloHeadroomTierParams
    params: SloHeadroomTierParams
    consumes = frozenset({LATENCY_PREDICTION_INFO_KEY})

    def __init__(
        self,
        name: str,
        params: SloHeadroomTierParams | None = None,
        handle: Handle | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        params = params if params is not None else SloHeadroomTierParams()
        super().__init__(name, params, handle)
        check_producers(handle, params)
        self._epsilon = params.epsilon_explore_neg
        self._random = (rng or random.Random()).random

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        if len(endpoints) <= 1:
            return endpoints
        infos = cycle.get(LATENCY_PREDICTION_INFO_KEY)
        if not infos:
            return endpoints
        positive: list[Endpoint] = []
        negative: list[Endpoint] = []
        predicted = False
        for e in endpoints:
            info = infos.get(e)
            if not isinstance(info, LatencyPredictionInfo):
                negative.append(e)  # cannot confirm the SLO
                continue
            predicted = True
            if info.ttft_headroom >= 0 and info.tpot_headroom >= 0:
                positive.append(e)
            else:
                negative.append(e)
        if not predicted:
            return endpoints
        if positive and negative:
            return negative if self._random() < self._epsilon else positive
        return positive or negative
