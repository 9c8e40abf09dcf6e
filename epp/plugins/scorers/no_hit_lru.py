"""``no-hit-lru-scorer``: spread cold (no prefix hit) requests over the least recently used endpoints."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

from epp.framework import (
    CycleState,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    SchedulingResult,
    Scorer,
    register,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.params import OMIT_UNSET
from epp.plugins.scorers._data_keys import check_producers

DEFAULT_LRU_SIZE = 1024
PREFILL_PROFILE = "prefill"


@dataclass(slots=True, frozen=True)
class NoHitLRUParams:
    lru_size: int = DEFAULT_LRU_SIZE
    prefix_plugin_type: str = field(default="", metadata=OMIT_UNSET)  # accepted, not used
    prefix_plugin_name: str = field(default="", metadata=OMIT_UNSET)  # accepted, not used
    prefix_match_info_producer_name: str = ""

    def effective(self) -> NoHitLRUParams:
        """With the LRU size used (≤ 0 means the default)."""
        return dataclasses.replace(self, lru_size=self.effective_lru_size)

    @property
    def effective_lru_size(self) -> int:
        return self.lru_size if self.lru_size > 0 else DEFAULT_LRU_SIZE


def _is_cold(cycle: CycleState, endpoints: list[Endpoint]) -> bool:
    infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
    if not infos:
        return True
    for e in endpoints:
        info = infos.get(e)
        if isinstance(info, PrefixCacheMatchInfo) and info.match_blocks > 0:
            return False
    return True


@register
class NoHitLRUScorer(Scorer, PreRequest):
    type_name = "no-hit-lru-scorer"
    category = "Distribution"
    Params = NoHitLRUParams
    params: NoHitLRUParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(self, name: str, params: NoHitLRUParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        check_producers(handle, params)
        self._capacity = params.effective_lru_size
        # endpoint key -> None, oldest first (insertion/move order = recency)
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._cold_key = f"{self.typed_name}/cold"

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        cold = _is_cold(cycle, endpoints)
        cycle[self._cold_key] = cold
        n = len(endpoints)
        if not cold:
            return [0.5] * n
        if n == 1:
            return [1.0]
        lru = self._lru
        used = {e.metadata.key for e in endpoints if e.metadata.key in lru}
        positions: dict[str, int] = {}
        if used:
            for pos, key in enumerate(lru):
                if key in used:
                    positions[key] = pos
                    if len(positions) == len(used):
                        break
        never_used = n - sum(1 for e in endpoints if e.metadata.key in positions)
        span = n - 1
        out = []
        i = 0
        for e in endpoints:
            lru_pos = positions.get(e.metadata.key)
            if lru_pos is None:
                out.append(1.0 - i / span)
                i += 1
            else:
                out.append(max(0.0, 1.0 - (never_used + lru_pos) / span))
        return out

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        if not cycle.pop(self._cold_key, False):
            return
        for profile in (result.primary_profile_name, PREFILL_PROFILE):
            run = result.profile_results.get(profile)
            if run is not None and run.target_endpoints:
                self._touch(run.target_endpoints[0].metadata.key)

    def _touch(self, key: str) -> None:
        """Mark ``key`` most recently used, evicting the oldest entry beyond capacity."""
        lru = self._lru
        if key in lru:
            lru.move_to_end(key)
            return
        lru[key] = None
        if len(lru) > self._capacity:
            lru.popitem(last=False)

    def lru_keys(self) -> list[str]:
        """Tracked endpoint keys, least recently used first (for tests and debugging)."""
        return list(self._lru)
