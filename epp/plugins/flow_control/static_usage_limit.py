"""``static-usage-limit-policy``: one fixed saturation ceiling for every band.

Created by default whenever flow control is configured; ``threshold: 1.0`` (the default) gates no
band below full saturation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework import Handle, UsageLimitPolicy, register
from epp.framework.params import ensure_valid


@dataclass(slots=True, frozen=True)
class StaticUsageLimitParams:
    threshold: float = 1.0

    def validate(self) -> str | None:
        if not 0.0 < self.threshold <= 1.0:  # also NaN
            return f"threshold: threshold must be in (0.0, 1.0], got {self.threshold:g}"
        return None


@register
class StaticUsageLimitPolicy(UsageLimitPolicy):
    """Writes ``threshold`` as the ceiling of every band."""

    type_name = "static-usage-limit-policy"
    Params = StaticUsageLimitParams
    params: StaticUsageLimitParams

    def __init__(
        self, name: str, params: StaticUsageLimitParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else StaticUsageLimitParams()
        ensure_valid(params)
        super().__init__(name, params, handle)
        self._threshold = params.threshold

    def compute_limit(self, saturation: float, priorities: Sequence[int], ceilings: list[float]) -> None:
        threshold = self._threshold
        for i in range(len(priorities)):
            ceilings[i] = threshold
