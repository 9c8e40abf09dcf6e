"""How popular each LoRA adapter has been lately, from the requests the EPP itself routes.

Exponentially decayed request counts per adapter, bounded in size; ``percentile`` ranks one adapter
among all tracked ones (0: the coldest, 1: the hottest), which says how much evicting it would cost;
``least_recent`` predicts which idle adapter an engine evicts.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

__all__ = ["AdapterHeat"]

_MAX_TRACKED = 4096


@dataclass(slots=True)
class _Count:
    value: float
    at: float


class AdapterHeat:
    """Decayed request counts per adapter (half-life ``half_life`` seconds)."""

    def __init__(self, half_life: float = 60.0, max_tracked: int = _MAX_TRACKED) -> None:
        self._rate = math.log(2.0) / half_life
        self._max = max_tracked
        self._counts: dict[str, _Count] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, adapter: str, now: float) -> None:
        """Count one request for ``adapter`` at ``now`` (monotonic seconds)."""
        c = self._counts.get(adapter)
        if c is None:
            if len(self._counts) >= self._max:
                self._prune(now)
            self._counts[adapter] = _Count(1.0, now)
            return
        c.value = self._decayed(c, now) + 1.0
        c.at = now

    def snapshot(self, now: float) -> _Ranking:
        """Every tracked adapter's count at ``now``, ranked."""
        values = {name: self._decayed(c, now) for name, c in self._counts.items()}
        last = {name: c.at for name, c in self._counts.items()}
        return _Ranking(values, sorted(values.values()), last)

    def _decayed(self, c: _Count, now: float) -> float:
        return c.value * math.exp(-self._rate * max(0.0, now - c.at))

    def _prune(self, now: float) -> None:
        """Drop the coldest half of the tracked adapters."""
        ranked = sorted(self._counts, key=lambda name: self._decayed(self._counts[name], now))
        for name in ranked[: len(ranked) // 2 + 1]:
            del self._counts[name]


@dataclass(slots=True, frozen=True)
class _Ranking:
    values: dict[str, float]
    ordered: list[float]
    last: dict[str, float]

    def least_recent(self, adapters: list[str]) -> str:
        """The adapter of ``adapters`` requested longest ago (one never seen first): the one an
        engine's least-recently-used eviction takes, while each adapter lives on one engine."""
        return min(adapters, key=lambda name: self.last.get(name, float("-inf")))

    def percentile(self, adapter: str) -> float:
        """The share of the other tracked adapters colder than ``adapter`` (an untracked one: 0)."""
        value = self.values.get(adapter)
        if value is None or len(self.ordered) <= 1:
            return 0.0
        return bisect.bisect_left(self.ordered, value) / (len(self.ordered) - 1)
