"""``fair-share-fairness-policy``: round robin between flows, each capped at its fair share of the pool.

While several flows of a band are active, each may hold in flight at most its share of the pool's
measured concurrency capacity; the unused part of a light flow's share stays free for it (``reserve``),
so its next request dispatches at once instead of waiting for a release behind a flood. A flow
alone in its band has no cap. Flows take turns, in fairness-id order, among those under their caps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from epp.framework import BandView, FairnessPolicy, FlowView, Handle, QueueItem, register
from epp.framework.params import ensure_valid


@dataclass(slots=True, frozen=True)
class FairShareParams:
    reserve: float = 1.0
    active_window_seconds: float = 1.0

    def validate(self) -> str | None:
        if not 0.0 <= self.reserve <= 1.0:  # also NaN
            return f"reserve: must be in [0.0, 1.0], got {self.reserve:g}"
        if not 0.0 <= self.active_window_seconds <= 3600.0:
            return f"activeWindowSeconds: must be in [0, 3600], got {self.active_window_seconds:g}"
        return None


@dataclass(slots=True)
class _State:
    last: str | None = None  # fairness id picked last (the rotation's cursor)
    seen: dict[str, float] = field(default_factory=dict)  # fairness id -> last dispatch (monotonic)
    caps: dict[str, float] = field(default_factory=dict)  # this cycle's caps (empty: none)


@register
class FairShareFairnessPolicy(FairnessPolicy):
    """Caps each active flow at max(share, capacity - the other flows' claims), then round robin."""

    type_name = "fair-share-fairness-policy"
    Params = FairShareParams
    params: FairShareParams

    def __init__(
        self, name: str, params: FairShareParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else FairShareParams()
        ensure_valid(params)
        super().__init__(name, params, handle)
        self._reserve = params.reserve
        self._window = params.active_window_seconds

    def new_state(self) -> _State:
        return _State()

    def _state(self, band: BandView) -> _State:
        state = band.policy_state
        if not isinstance(state, _State):
            raise TypeError(f"{self.typed_name}: band state is {type(state).__name__}, not its own")
        return state

    def flow_caps(self, band: BandView, capacity: float) -> Mapping[str, float] | None:
        state = self._state(band)
        caps = state.caps
        caps.clear()
        now = time.monotonic()
        seen = state.seen
        horizon = now - self._window
        for fid in [f for f, t in seen.items() if t < horizon]:
            del seen[fid]
        queued = [flow.key.id for flow in band.flows()]
        active = {*queued, *band.inflight_flows(), *seen}
        k = len(active)
        if k <= 1 or capacity <= 0.0:
            return None
        share = capacity / k
        reserve = self._reserve
        claims = 0.0
        claim: dict[str, float] = {}
        for fid in active:
            n = band.inflight_of(fid)
            c = n + reserve * (share - n) if n < share else float(n)
            claim[fid] = c
            claims += c
        for fid in queued:
            rest = capacity - (claims - claim[fid])
            caps[fid] = rest if rest > share else share
        return caps

    def pick(self, band: BandView) -> FlowView | None:
        state = self._state(band)
        caps = state.caps
        last = state.last
        first: FlowView | None = None  # the smallest eligible id (where the rotation wraps to)
        after: FlowView | None = None  # the smallest eligible id greater than the last pick
        for flow in band.flows():
            fid = flow.key.id
            if caps and band.inflight_of(fid) >= caps.get(fid, math.inf):
                continue
            if first is None or fid < first.key.id:
                first = flow
            if last is not None and fid > last and (after is None or fid < after.key.id):
                after = flow
        chosen = after if after is not None else first
        if chosen is not None:
            state.last = chosen.key.id
        return chosen

    def dispatched(self, band: BandView, item: QueueItem) -> None:
        if self._window > 0.0:
            self._state(band).seen[item.key.id] = time.monotonic()
