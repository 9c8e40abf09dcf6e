"""``prefix-cache-affinity-filter``: narrow the candidates to endpoints that hold the prompt's prefix.

Sticky endpoints are those whose prefix-match ratio reaches ``affinityThreshold``; a TTFT load gate
and an exploration probability keep the stickiness from hot-spotting.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, register
from epp.framework.attributes import (
    INFLIGHT_LOAD_KEY,
    LATENCY_PREDICTION_INFO_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
    InFlightLoad,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from epp.plugins.scorers._data_keys import check_producers

__all__ = ["PrefixCacheAffinityFilter", "PrefixCacheAffinityParams"]

PREFILL_THROUGHPUT = "prefillThroughput"
LATENCY_PREDICTOR = "latencyPredictor"


@dataclass(slots=True, frozen=True)
class PrefixCacheAffinityParams:
    affinity_threshold: float = 0.80
    exploration_probability: float = 0.0
    max_ttft_penalty_ms: float = field(default=18000.0, metadata={"key": "maxTTFTPenaltyMs"})
    ttft_source: str = PREFILL_THROUGHPUT
    peak_prefill_throughput: float = 15928.0
    prefix_match_info_producer_name: str = ""
    latency_prediction_info_producer_name: str = ""
    in_flight_load_producer_name: str = ""

    def validate(self) -> str | None:
        if self.affinity_threshold > 1.0:
            return f"affinityThreshold: must be <= 1.0, got {self.affinity_threshold}"
        if not 0.0 <= self.exploration_probability <= 1.0:
            return f"explorationProbability: must be in [0, 1], got {self.exploration_probability}"
        if self.max_ttft_penalty_ms < 0:
            return f"maxTTFTPenaltyMs: must be >= 0, got {self.max_ttft_penalty_ms}"
        if self.peak_prefill_throughput < 0:
            return f"peakPrefillThroughput: must be >= 0, got {self.peak_prefill_throughput}"
        if self.ttft_source not in (PREFILL_THROUGHPUT, LATENCY_PREDICTOR):
            return (
                f'ttftSource: must be "{LATENCY_PREDICTOR}" or "{PREFILL_THROUGHPUT}", '
                f'got "{self.ttft_source}"'
            )
        if (
            self.ttft_source == PREFILL_THROUGHPUT
            and self.max_ttft_penalty_ms > 0
            and self.peak_prefill_throughput == 0
        ):
            return "peakPrefillThroughput: must be > 0 when ttftSource is prefillThroughput"
        return None


@register
class PrefixCacheAffinityFilter(Filter):
    type_name = "prefix-cache-affinity-filter"
    Params = PrefixCacheAffinityParams
    params: PrefixCacheAffinityParams

    def __init__(self, name: str, params: PrefixCacheAffinityParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        check_producers(handle, params)
        self._gate = params.max_ttft_penalty_ms > 0
        self._predicted = params.ttft_source == LATENCY_PREDICTOR
        keys = {PREFIX_CACHE_MATCH_INFO_KEY}
        if self._gate:
            keys.add(LATENCY_PREDICTION_INFO_KEY if self._predicted else INFLIGHT_LOAD_KEY)
        object.__setattr__(self, "consumes", frozenset(keys))
        self.rng = random.Random()

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        p = self.params
        if len(endpoints) <= 1 or p.affinity_threshold <= 0:
            return list(endpoints)
        if p.exploration_probability > 0 and self.rng.random() < p.exploration_probability:
            return list(endpoints)
        infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
        if not isinstance(infos, dict) or not infos:
            return list(endpoints)
        threshold = p.affinity_threshold
        sticky: list[Endpoint] = []
        others: list[Endpoint] = []
        for e in endpoints:
            info = infos.get(e)
            ratio = (
                info.match_blocks / info.total_blocks
                if isinstance(info, PrefixCacheMatchInfo) and info.total_blocks > 0
                else 0.0
            )
            (sticky if ratio >= threshold else others).append(e)
        if not sticky:
            return list(endpoints)
        if self._gate and others:
            data = cycle.get(LATENCY_PREDICTION_INFO_KEY if self._predicted else INFLIGHT_LOAD_KEY)
            data = data if isinstance(data, dict) else {}
            # inf - inf is nan: without predictions on either side the gate stays shut
            if self._best_ttft(sticky, data) - self._best_ttft(others, data) > p.max_ttft_penalty_ms:
                return list(endpoints)
        return sticky

    def _best_ttft(self, endpoints: list[Endpoint], data: dict[Endpoint, object]) -> float:
        """The lowest TTFT (ms): predicted (an endpoint without a prediction counts as infinite), or
        in-flight tokens / peak prefill throughput (no load data = 0 tokens)."""
        best = math.inf
        for e in endpoints:
            value = data.get(e)
            if self._predicted:
                ttft = value.ttft if isinstance(value, LatencyPredictionInfo) else math.inf
            else:
                tokens = value.tokens if isinstance(value, InFlightLoad) else 0
                ttft = tokens / self.params.peak_prefill_throughput * 1000.0
            best = min(best, ttft)
        return best
