"""``probabilistic-admitter``: sheds sheddable requests with a probability that rises with saturation.

Requests with priority >= 0 are always admitted. For a sheddable one (priority < 0) the pool's
saturation is the mean over the candidates of ``max(waiting / queueDepthThreshold, kv /
kvCacheUtilThreshold)`` (an endpoint without known metrics counts as 1.0), and the request is
rejected with probability ``min(saturation ** power * k, 1)``: 429 with the reason header.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from epp.framework import (
    Admitter,
    CycleState,
    Endpoint,
    ErrorCode,
    Handle,
    InferenceError,
    LLMRequest,
    register,
)
from epp.framework.wire import REQUEST_DROPPED_REASON_HEADER

__all__ = ["ProbabilisticAdmitter", "ProbabilisticAdmitterParams"]

REJECTED_SATURATED = "rejected-saturated"  # the reference's dropped-reason value for a busy pool


@dataclass(slots=True, frozen=True)
class ProbabilisticAdmitterParams:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    power: float = 5.0
    k: float = 300.0

    def validate(self) -> str | None:
        if self.queue_depth_threshold <= 0:
            return f"queueDepthThreshold: must be > 0, got {self.queue_depth_threshold}"
        if self.kv_cache_util_threshold <= 0:
            return f"kvCacheUtilThreshold: must be > 0, got {self.kv_cache_util_threshold:g}"
        if self.power <= 0:
            return f"power: must be > 0, got {self.power:g}"
        if self.k <= 0:
            return f"k: must be > 0, got {self.k:g}"
        return None


@register
class ProbabilisticAdmitter(Admitter):
    type_name = "probabilistic-admitter"
    Params = ProbabilisticAdmitterParams
    params: ProbabilisticAdmitterParams

    def __init__(
        self,
        name: str,
        params: ProbabilisticAdmitterParams | None = None,
        handle: Handle | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        params = params if params is not None else ProbabilisticAdmitterParams()
        super().__init__(name, params, handle)
        self._qd = float(params.queue_depth_threshold)
        self._kv = params.kv_cache_util_threshold
        self._power = params.power
        self._k = params.k
        self._random = (rng or random.Random()).random

    def saturation(self, endpoints: list[Endpoint]) -> float:
        """Mean per-endpoint saturation; 0.0 for no endpoints."""
        if not endpoints:
            return 0.0
        qd, kv = self._qd, self._kv
        total = 0.0
        for e in endpoints:
            m = e.metrics
            if m.update_time == 0.0:  # never scraped: nothing known, counted as saturated
                total += 1.0
                continue
            total += max(m.waiting_queue_size / qd, m.kv_cache_usage_percent / kv)
        return total / len(endpoints)

    def probability(self, saturation: float) -> float:
        """The rejection probability of a sheddable request at ``saturation``."""
        return min(saturation**self._power * self._k, 1.0)

    def admit(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> InferenceError | None:
        if request.priority >= 0 or not endpoints:
            return None
        saturation = self.saturation(endpoints)
        p = self.probability(saturation)
        if self._random() < p:
            return InferenceError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"probabilistic-admitter: rejected, saturation={saturation:.3f} prob={p:.2f}",
                headers={REQUEST_DROPPED_REASON_HEADER: REJECTED_SATURATED},
            )
        return None
