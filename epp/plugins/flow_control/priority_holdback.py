"""``priority-holdback-policy``: lower priorities get lower saturation ceilings.

Ceilings run linearly from ``maxCeiling`` (the highest priority with queued requests) down to
``minCeiling`` (the lowest), spaced by rank or by priority value, so low-priority traffic is held
back first as the pool fills.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework import Handle, Stability, UsageLimitPolicy, register
from epp.framework.params import ensure_valid

SHAPES = ("linear",)
DOMAINS = ("rank", "value")


@dataclass(slots=True, frozen=True)
class PriorityHoldbackParams:
    min_ceiling: float | None = None  # required
    shape: str = "linear"
    domain: str = "rank"
    max_ceiling: float = 1.0

    def validate(self) -> str | None:
        if self.min_ceiling is None:
            return "minCeiling: invalid priority holdback policy configuration: minCeiling is required"
        problems: list[tuple[str, str]] = []
        if self.shape not in SHAPES:
            problems.append(("shape", f'unsupported shape {self.shape!r}, must be "linear"'))
        if self.domain not in DOMAINS:
            problems.append(
                ("domain", f'unsupported domain {self.domain!r}, must be one of: "rank", "value"')
            )
        lo, hi = self.min_ceiling, self.max_ceiling
        if not 0.0 <= lo < 1.0:
            problems.append(("minCeiling", f"minCeiling must be in [0.0, 1.0), got {lo:g}"))
        if not 0.0 < hi <= 1.0:
            problems.append(("maxCeiling", f"maxCeiling must be in (0.0, 1.0], got {hi:g}"))
        if lo >= hi:
            problems.append(
                ("minCeiling", f"minCeiling ({lo:g}) must be strictly less than maxCeiling ({hi:g})")
            )
        if not problems:
            return None
        reasons = "; ".join(reason for _, reason in problems)
        return f"{problems[0][0]}: invalid priority holdback policy configuration: {reasons}"


@register
class PriorityHoldbackPolicy(UsageLimitPolicy):
    """``rank``: ``c_i = max - i·(max - min)/(N - 1)``; ``value``: ``c_i = min + r_i·(max - min)``
    with ``r_i = (p_i - p_min)/(p_max - p_min)``. A single band gets ``maxCeiling``."""

    type_name = "priority-holdback-policy"
    stability = Stability.ALPHA
    Params = PriorityHoldbackParams
    params: PriorityHoldbackParams

    def __init__(
        self, name: str, params: PriorityHoldbackParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else PriorityHoldbackParams()
        ensure_valid(params)
        super().__init__(name, params, handle)
        assert params.min_ceiling is not None  # validated
        self._min = params.min_ceiling
        self._max = params.max_ceiling
        self._by_value = params.domain == "value"

    def compute_limit(self, saturation: float, priorities: Sequence[int], ceilings: list[float]) -> None:
        n = len(priorities)
        if n == 0:
            return
        lo, hi = self._min, self._max
        if n == 1:
            ceilings[0] = hi
            return
        spread = hi - lo
        if self._by_value:
            p_max, p_min = priorities[0], priorities[-1]
            p_range = p_max - p_min
            for i, p in enumerate(priorities):
                ceilings[i] = hi if p_range == 0 else lo + (p - p_min) / p_range * spread
            return
        step = spread / (n - 1)
        for i in range(n):
            ceilings[i] = hi - i * step
