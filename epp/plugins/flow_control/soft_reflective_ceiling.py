"""``soft-reflective-ceiling-policy``: saturation-dependent ceilings with a duty cycle.

Band ``i`` of ``N`` (highest priority first) is open while saturation is below
``1 - i·saturation/(N - 1)``; past that it opens on one of every ``round(s/(1 - s))`` dispatch
cycles, so its dispatch rate falls continuously as saturation rises. No parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from epp.framework import Handle, NoParams, Stability, UsageLimitPolicy, register

_EPS = 1e-9  # keeps the period finite just below full saturation


@register
class SoftReflectiveCeilingPolicy(UsageLimitPolicy):
    """All gated bands share one cycle counter, so on any cycle either every gated band is open or
    every one is closed (ceilings never increase with rank)."""

    type_name = "soft-reflective-ceiling-policy"
    stability = Stability.ALPHA

    def __init__(self, name: str, params: NoParams | None = None, handle: Handle | None = None) -> None:
        super().__init__(name, params if params is not None else NoParams(), handle)
        self._tick = 0

    def compute_limit(self, saturation: float, priorities: Sequence[int], ceilings: list[float]) -> None:
        n = len(priorities)
        if n == 0:
            return
        ceilings[0] = 1.0
        if n == 1:
            return
        open_ = False
        if 1.0 - saturation <= saturation < 1.0:  # the lowest band (ceiling 1 - s) is gated
            period = max(1, math.floor(saturation / (1.0 - saturation + _EPS) + 0.5))
            self._tick += 1
            open_ = self._tick % period == 0
        step = saturation / (n - 1)
        for i in range(1, n):
            if saturation < 1.0 - i * step:
                ceilings[i] = 1.0
            elif saturation >= 1.0:
                ceilings[i] = 0.0
            else:
                ceilings[i] = 1.0 if open_ else 0.0
