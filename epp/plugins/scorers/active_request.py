"""``active-request-scorer``: prefer endpoints with fewer requests in flight from this EPP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, register
from epp.framework.attributes import INFLIGHT_LOAD_KEY, InFlightLoad
from epp.framework.params import OMIT_UNSET

__all__ = ["ActiveRequestParams", "ActiveRequestScorer"]


@dataclass(slots=True, frozen=True)
class ActiveRequestParams:
    idle_threshold: int = 0
    max_busy_score: float = 1.0
    request_timeout: str | int | float | None = field(
        default=None, metadata=OMIT_UNSET
    )  # deprecated, ignored

    def validate(self) -> str | None:
        if not 0.0 <= self.max_busy_score <= 1.0:
            return "maxBusyScore: must be in [0, 1]"
        return None


@register
class ActiveRequestScorer(Scorer):
    type_name = "active-request-scorer"
    category = "Distribution"
    Params = ActiveRequestParams
    params: ActiveRequestParams
    consumes = frozenset({INFLIGHT_LOAD_KEY})

    def __init__(
        self, name: str, params: ActiveRequestParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else ActiveRequestParams()
        super().__init__(name, params)
        self._idle = max(0, params.idle_threshold)
        self._max_busy = params.max_busy_score

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        loads = cycle.get(INFLIGHT_LOAD_KEY)
        n = len(endpoints)
        if not loads:
            return [1.0] * n  # nothing in flight anywhere (or no producer): every endpoint is idle
        get = loads.get
        counts = [load.requests if isinstance(load := get(e), InFlightLoad) else 0 for e in endpoints]
        max_count = max(counts, default=0)
        idle = self._idle
        busy = self._max_busy
        return [1.0 if c <= idle else (max_count - c) / max_count * busy for c in counts]
