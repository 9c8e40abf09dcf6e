"""``utilization-filter``: drop endpoints over any of the configured utilization caps."""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest, Stability, register
from epp.framework.attributes import INFLIGHT_LOAD_KEY, InFlightLoad
from epp.plugins.scorers._data_keys import check_producers

__all__ = ["UtilizationCondition", "UtilizationFilter", "UtilizationFilterParams"]

ACTIVE_REQUESTS = "active-requests"
RUNNING_REQUESTS = "running-requests"
WAITING_QUEUE = "waiting-queue"
KV_CACHE_UTILIZATION = "kv-cache-utilization"
_METRICS = (ACTIVE_REQUESTS, RUNNING_REQUESTS, WAITING_QUEUE, KV_CACHE_UTILIZATION)


@dataclass(slots=True, frozen=True)
class UtilizationCondition:
    """An endpoint passes when its ``metric`` is at most ``maxValue``."""

    metric: str = ""
    max_value: float | None = None

    def validate(self) -> str | None:
        if self.metric not in _METRICS:
            return (
                "metric: must be one of " + ", ".join(f'"{m}"' for m in _METRICS) + f', got "{self.metric}"'
            )
        if self.max_value is None:
            return f'maxValue: required (condition for "{self.metric}")'
        if self.max_value < 0:
            return f"maxValue: must be non-negative, got {self.max_value}"
        if self.metric == KV_CACHE_UTILIZATION and self.max_value > 1:
            return (
                f'maxValue: for "{KV_CACHE_UTILIZATION}" is a fraction and must be at most 1, '
                f"got {self.max_value}"
            )
        return None


@dataclass(slots=True, frozen=True)
class UtilizationFilterParams:
    conditions: tuple[UtilizationCondition, ...] = ()
    fallback_on_empty: bool = False
    in_flight_load_producer_name: str = ""

    def validate(self) -> str | None:
        if not self.conditions:
            return "conditions: utilization filter requires at least one condition"
        return None


@register
class UtilizationFilter(Filter):
    type_name = "utilization-filter"
    stability = Stability.ALPHA
    Params = UtilizationFilterParams
    params: UtilizationFilterParams

    def __init__(self, name: str, params: UtilizationFilterParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        check_producers(handle, params)
        caps: dict[str, float] = {}
        for c in params.conditions:  # the same metric twice: the tighter cap decides
            assert c.max_value is not None  # validated
            caps[c.metric] = min(caps.get(c.metric, c.max_value), c.max_value)
        self._active = caps.get(ACTIVE_REQUESTS)
        self._running = caps.get(RUNNING_REQUESTS)
        self._waiting = caps.get(WAITING_QUEUE)
        self._kv = caps.get(KV_CACHE_UTILIZATION)
        if self._active is not None:
            object.__setattr__(self, "consumes", frozenset({INFLIGHT_LOAD_KEY}))

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        active, running, waiting, kv = self._active, self._running, self._waiting, self._kv
        loads = cycle.get(INFLIGHT_LOAD_KEY) if active is not None else None
        get = loads.get if isinstance(loads, dict) else None
        kept: list[Endpoint] = []
        for e in endpoints:
            m = e.metrics
            if running is not None and m.running_requests_size > running:
                continue
            if waiting is not None and m.waiting_queue_size > waiting:
                continue
            if kv is not None and m.kv_cache_usage_percent > kv:
                continue
            if active is not None:
                load = get(e) if get is not None else None
                if isinstance(load, InFlightLoad) and load.requests > active:
                    continue
            kept.append(e)
        if not kept and self.params.fallback_on_empty:
            return list(endpoints)
        return kept
