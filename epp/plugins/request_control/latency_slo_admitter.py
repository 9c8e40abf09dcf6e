"""``latency-slo-admitter``: reject a sheddable request with SLOs when no endpoint can meet them.

Admits when some candidate has a valid ``LatencyPredictionInfo`` (both SLOs met), is idle (no
running requests) or is cold (KV cache below 2%, where predictions are unreliable). Requests with
priority >= 0, without SLO headers, or without any prediction are always admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import Admitter, CycleState, Endpoint, Handle, InferenceError, LLMRequest, register
from epp.framework.attributes import LATENCY_PREDICTION_INFO_KEY, LatencyPredictionInfo
from epp.framework.errors import saturated
from epp.plugins.scorers._data_keys import check_producers

__all__ = ["COLD_KV_CACHE_USAGE", "LatencySloAdmitter", "LatencySloAdmitterParams"]

COLD_KV_CACHE_USAGE = 0.02
REJECT_MESSAGE = "request cannot be admitted: no valid endpoint available to serve the request"


@dataclass(slots=True, frozen=True)
class LatencySloAdmitterParams:
    latency_prediction_info_producer_name: str = ""


@register
class LatencySloAdmitter(Admitter):
    type_name = "latency-slo-admitter"
    Params = LatencySloAdmitterParams
    params: LatencySloAdmitterParams
    consumes = frozenset({LATENCY_PREDICTION_INFO_KEY})

    def __init__(
        self, name: str, params: LatencySloAdmitterParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else LatencySloAdmitterParams()
        super().__init__(name, params, handle)
        check_producers(handle, params)

    def admit(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> InferenceError | None:
        if request.priority >= 0 or (request.slo_ttft_ms <= 0 and request.slo_tpot_ms <= 0):
            return None
        infos = cycle.get(LATENCY_PREDICTION_INFO_KEY)
        if not infos:
            return None  # no predictions: fail open
        predicted = False
        for e in endpoints:
            m = e.metrics
            if m.kv_cache_usage_percent < COLD_KV_CACHE_USAGE or m.running_requests_size == 0:
                return None  # cold or idle
            info = infos.get(e)
            if isinstance(info, LatencyPredictionInfo):
                predicted = True
                if info.valid:
                    return None
        if not predicted:
            return None
        return saturated(f"{self.type_name}: {REJECT_MESSAGE}")
