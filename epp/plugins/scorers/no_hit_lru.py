"""``no-hit-lru-scorer``: spread cold (no prefix hit) requests over the least recently used endpoints.

With a cross-replica syncer the recency is the fleet's: each replica publishes when it last sent a
cold request to each endpoint, and orders its LRU by the latest of its own and its peers' times.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
from epp.framework.cross_replica import SharedValue, fold_max, valid_time
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
        # endpoint key -> wall time of its last cold pick (None unless shared), oldest first
        # (insertion/move order = recency)
        self._lru: OrderedDict[str, float | None] = OrderedDict()
        self._cold_key = f"{self.typed_name}/cold"
        self._mine: dict[str, float] | None = None  # this replica's cold picks (a syncer), by endpoint

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
        mine = self._mine
        when = None
        if mine is not None:
            when = mine[key] = time.time()
        if key in lru:
            if mine is not None:
                lru[key] = when
            lru.move_to_end(key)
            return
        lru[key] = when
        if len(lru) > self._capacity:
            lru.popitem(last=False)

    # --- shared with the other replicas (a cross-replica syncer) --------------------------------

    def cross_replica_specs(self) -> list[SharedValue]:
        """Per endpoint, the wall time of this replica's last cold pick; the latest over the
        replicas orders every replica's LRU."""
        if self._mine is None:
            self._mine = {}
        return [
            SharedValue(
                state_key=f"{self.type_name}/{self.name}",
                supply=self._supply,
                aggregate=fold_max,
                install=self._install_peers,
                valid=valid_time,
            )
        ]

    def _supply(self) -> dict[str, float]:
        mine, lru = self._mine or {}, self._lru
        for key in [k for k in mine if k not in lru]:  # evicted from the LRU, or the endpoint left
            del mine[key]
        return dict(mine)

    def _install_peers(self, folded: Mapping[str, Any]) -> None:
        """Order the LRU by each endpoint's latest cold pick, ours or a peer's (on change only)."""
        lru = self._lru
        changed = False
        for key, when in folded.items():
            if (lru.get(key) or 0.0) < when:
                lru[key] = when
                changed = True
        if not changed:
            return
        merged = sorted(lru.items(), key=lambda kv: kv[1] or 0.0)
        self._lru = OrderedDict(merged[-self._capacity :])

    def lru_keys(self) -> list[str]:
        """Tracked endpoint keys, least recently used first (for tests and debugging)."""
        return list(self._lru)
