"""``lora-load-state-scorer``: prefer endpoints where the requested LoRA adapter is already resident.

Scores by residency tier (GPU slot, host cache, free slot, evictable, saturated) read from the
engine's adapter residency metrics, with small bonuses that make an adapter's first misses converge
on one home and break ties toward free slots. Where a load must evict an idle adapter, the endpoint
whose likely victim (its idle adapter requested longest ago) is least popular lately, by the
requests this EPP routed, scores highest within its tier: the long tail churns through the same
slots and hot adapters stay resident.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from epp.framework import LORA_GPU, CycleState, Endpoint, Handle, LLMRequest, Metrics, Stability, register
from epp.plugins.scorers._adapter_heat import AdapterHeat
from epp.plugins.scorers._metric_scorer import MetricScorer

__all__ = ["LoraLoadStateScorer", "LoraLoadStateScorerParams"]

_TIERS = ("gpuResidentScore", "cpuResidentScore", "freeSlotScore", "evictableScore", "saturatedScore")


@dataclass(slots=True, frozen=True)
class LoraLoadStateScorerParams:
    gpu_resident_score: float = 1.0
    cpu_resident_score: float = 0.7
    free_slot_score: float = 0.6
    evictable_score: float = 0.3
    saturated_score: float = 0.0
    placement_bonus: float = 0.03
    headroom_bonus: float = 0.03
    protect_hot_adapters: bool = True
    popularity_half_life_seconds: float = 60.0

    def tiers(self) -> tuple[float, ...]:
        return (
            self.gpu_resident_score,
            self.cpu_resident_score,
            self.free_slot_score,
            self.evictable_score,
            self.saturated_score,
        )

    def validate(self) -> str | None:
        values = dict(zip(_TIERS, self.tiers(), strict=True))
        values["placementBonus"] = self.placement_bonus
        values["headroomBonus"] = self.headroom_bonus
        for name, value in values.items():
            if not 0.0 <= value <= 1.0:
                return f"{name}: must be in [0, 1], got {value}"
        if self.popularity_half_life_seconds <= 0:
            return f"popularityHalfLifeSeconds: must be > 0, got {self.popularity_half_life_seconds}"
        budget = self.placement_bonus + self.headroom_bonus
        if budget >= 1.0:
            return f"placementBonus: placementBonus + headroomBonus must be below 1, got {budget}"
        tiers = self.tiers()
        for i in range(1, len(tiers)):
            gap = tiers[i - 1] - tiers[i]
            if gap < 0:
                return f"{_TIERS[i]}: must be at most {_TIERS[i - 1]} ({tiers[i - 1]}), got {tiers[i]}"
            if gap > 0 and gap * (1.0 - budget) <= budget:
                return (
                    f"{_TIERS[i]}: the gap to {_TIERS[i - 1]} ({gap:g}) must exceed the bonuses "
                    f"(placementBonus + headroomBonus = {budget:g}) so a bonus never crosses a tier"
                )
        return None


@register
class LoraLoadStateScorer(MetricScorer):
    type_name = "lora-load-state-scorer"
    category = "Affinity"
    stability = Stability.ALPHA
    Params = LoraLoadStateScorerParams
    params: LoraLoadStateScorerParams

    def __init__(self, name: str, params: LoraLoadStateScorerParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._budget = params.placement_bonus + params.headroom_bonus
        self._scale = 1.0 - self._budget
        self._heat = AdapterHeat(params.popularity_half_life_seconds)

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        adapter = request.target_model
        scale = self._scale
        if _is_base_model(adapter, endpoints):
            return [_base_model_headroom(e.metrics) * scale for e in endpoints]
        p = self.params
        now = time.monotonic()
        if p.protect_hot_adapters:
            self._heat.add(adapter, now)
        ranking = None
        home = _rendezvous(adapter, endpoints)
        out: list[float] = []
        for e in endpoints:
            m = e.metrics
            level = m.lora_level(adapter)
            if level == LORA_GPU:
                score = p.gpu_resident_score * scale
            else:
                tier = self._tier(m, level)
                score = tier * scale
                if p.protect_hot_adapters and _must_evict(m, tier, p):
                    ranking = ranking or self._heat.snapshot(now)
                    victim = ranking.least_recent(_idle_residents(m))
                    score -= self._room_below(tier) * ranking.percentile(victim)
                if e is home:
                    score += p.placement_bonus
            slots = m.max_active_models
            used = m.lora_slots_used()
            if slots > 0 and used < slots:
                score += p.headroom_bonus * (slots - used) / slots
            out.append(score)
        return out

    def _room_below(self, tier: float) -> float:
        """How far a score may drop inside ``tier`` without reaching the next tier's best score."""
        tiers = self.params.tiers()
        below = max((t for t in tiers if t < tier), default=0.0)
        return max(0.0, (tier - below) * self._scale - self._budget) * 0.95

    def _tier(self, m: Metrics, level: str) -> float:
        p = self.params
        if level:  # the host cache
            return p.cpu_resident_score
        if m.lora_slots_used() < m.max_active_models:
            return p.free_slot_score
        if m.lora_idle_resident():
            return p.evictable_score
        return p.saturated_score


def _must_evict(m: Metrics, tier: float, p: LoraLoadStateScorerParams) -> bool:
    """Loading here evicts an idle adapter (host-cache or evictable tier, every slot taken)."""
    return (
        tier in (p.cpu_resident_score, p.evictable_score)
        and m.max_active_models > 0
        and m.lora_slots_used() >= m.max_active_models
        and m.lora_idle_resident()
    )


def _idle_residents(m: Metrics) -> list[str]:
    """The GPU-resident adapters with no running request (the engine evicts one of them)."""
    active = m.active_models
    return [name for name, level in m.loaded_adapters.items() if level == LORA_GPU and name not in active]


def _is_base_model(model: str, endpoints: list[Endpoint]) -> bool:
    """No adapter to place: the request names nothing, or a base model an endpoint serves, or no
    candidate serves adapters at all (no adapter slots reported)."""
    if not model:
        return True
    lora = False
    for e in endpoints:
        m = e.metrics
        if model in m.served_models:
            return True
        lora = lora or m.max_active_models > 0
    return not lora


def _base_model_headroom(m: Metrics) -> float:
    """The share of adapter slots not serving a request now: base-model traffic drifts away from
    engines batching adapter work (an engine reporting no slots scores 1)."""
    slots = m.max_active_models
    if slots <= 0:
        return 1.0
    return max(slots - len(m.active_models), 0) / slots


def _rendezvous(adapter: str, endpoints: list[Endpoint]) -> Endpoint | None:
    """The endpoint with the highest hash of (adapter, endpoint key): stable, and only the adapters
    of an endpoint that leaves move."""
    best: Endpoint | None = None
    best_hash = -1
    prefix = adapter.encode() + b"\0"
    for e in endpoints:
        h = int.from_bytes(hashlib.blake2b(prefix + e.metadata.key.encode(), digest_size=8).digest())
        if h > best_hash:
            best, best_hash = e, h
    return best
