"""``lora-residency-filter``: keep a LoRA request on the endpoints where its adapter holds a GPU slot.

Opens one new copy elsewhere only when every holder is saturated and the adapter has fewer than
``maxReplicas`` copies; each decision is counted by outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp import promlite
from epp.framework import (
    LORA_GPU,
    CycleState,
    Endpoint,
    Filter,
    Handle,
    LLMRequest,
    Metrics,
    Stability,
    register,
)

__all__ = ["LoraResidencyFilter", "LoraResidencyFilterParams"]

TYPE_NAME = "lora-residency-filter"

NOT_APPLICABLE = "not_applicable"
NO_HOME = "no_home"
STICKY = "sticky"
CAP_BLOCKED = "cap_blocked"
SPREAD = "spread"
FLEET_SATURATED = "fleet_saturated"
OUTCOMES = (NOT_APPLICABLE, NO_HOME, STICKY, CAP_BLOCKED, SPREAD, FLEET_SATURATED)

DECISIONS = promlite.Counter(
    "llm_d_router_endpoint_picker_lora_residency_filter_decisions_total",
    "[ALPHA] Decisions of the LoRA residency filter, by outcome.",
    ["plugin_name", "outcome"],
)
promlite.register(DECISIONS, owners=(TYPE_NAME,))


@dataclass(slots=True, frozen=True)
class LoraResidencyFilterParams:
    """``maxReplicas``: most endpoints one adapter may occupy (0: unbounded); an endpoint is
    saturated past ``queueThreshold`` waiting requests or ``kvCacheThreshold`` KV usage (0 disables)."""

    max_replicas: int = 0
    queue_threshold: int = 8
    kv_cache_threshold: float = 0.8

    def validate(self) -> str | None:
        if self.max_replicas < 0:
            return f"maxReplicas: must be >= 0, got {self.max_replicas}"
        if self.queue_threshold < 0:
            return f"queueThreshold: must be >= 0, got {self.queue_threshold}"
        if not 0.0 <= self.kv_cache_threshold <= 1.0:
            return f"kvCacheThreshold: must be in [0, 1], got {self.kv_cache_threshold}"
        return None


@register
class LoraResidencyFilter(Filter):
    type_name = TYPE_NAME
    stability = Stability.ALPHA
    Params = LoraResidencyFilterParams
    params: LoraResidencyFilterParams

    def __init__(self, name: str, params: LoraResidencyFilterParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._counters = {outcome: DECISIONS.labels(name, outcome) for outcome in OUTCOMES}

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        adapter = request.target_model
        if not adapter or len(endpoints) <= 1:
            return self._decide(NOT_APPLICABLE, endpoints)
        homes: list[Endpoint] = []
        warm: list[Endpoint] = []
        cold: list[Endpoint] = []
        for e in endpoints:
            level = e.metrics.lora_level(adapter)
            (homes if level == LORA_GPU else warm if level else cold).append(e)
        if not homes:
            return self._decide(NO_HOME, endpoints)
        if any(not self._saturated(e.metrics) for e in homes):
            return self._decide(STICKY, homes)
        if 0 < self.params.max_replicas <= len(homes):
            return self._decide(CAP_BLOCKED, homes)
        for group in (warm, cold):
            spare = [e for e in group if not self._saturated(e.metrics)]
            if spare:
                return self._decide(SPREAD, spare)
        return self._decide(FLEET_SATURATED, homes)

    def _saturated(self, m: Metrics) -> bool:
        p = self.params
        if p.queue_threshold > 0 and m.waiting_queue_size > p.queue_threshold:
            return True
        return p.kv_cache_threshold > 0 and m.kv_cache_usage_percent > p.kv_cache_threshold

    def _decide(self, outcome: str, kept: list[Endpoint]) -> list[Endpoint]:
        self._counters[outcome].inc()
        return kept
