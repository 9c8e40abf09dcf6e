"""``fair-share-fairness-policy``: round robin between flows, each capped at its fair share of the pool.

While several flows of a band are active, each may hold in flight at most its share of the pool's
measured concurrency capacity; the unused part of a light flow's share stays free for it (``reserve``),
so its next request dispatches at once instead of waiting for a release behind a flood. A flow
asking for less than the band's mean rate (served over ``rateWindowSeconds``, plus its backlog
spread over that window) is light: uncapped, and first.
A flow alone in its band has no cap. Flows take turns, in fairness-id order, among those eligible.
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
    rate_window_seconds: float = 2.0

    def validate(self) -> str | None:
        if not 0.0 <= self.reserve <= 1.0:  # also NaN
            return f"reserve: must be in [0.0, 1.0], got {self.reserve:g}"
        if not 0.0 <= self.active_window_seconds <= 3600.0:
            return f"activeWindowSeconds: must be in [0, 3600], got {self.active_window_seconds:g}"
        if not 0.01 <= self.rate_window_seconds <= 3600.0:
            return f"rateWindowSeconds: must be in [0.01, 3600], got {self.rate_window_seconds:g}"
        return None


@dataclass(slots=True)
class _State:
    last: str | None = None  # fairness id picked last (the rotation's cursor)
    seen: dict[str, float] = field(default_factory=dict)  # fairness id -> last dispatch (monotonic)
    caps: dict[str, float] = field(default_factory=dict)  # this cycle's caps (empty: none)
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (dispatch rate, as of)
    light: set[str] = field(default_factory=set)  # this cycle's flows served under their rate share


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
        self._tau = params.rate_window_seconds

    def new_state(self) -> _State:
        return _State()

    def _state(self, band: BandView) -> _State:
        state = band.policy_state
        if not isinstance(state, _State):
            raise TypeError(f"{self.typed_name}: band state is {type(state).__name__}, not its own")
        return state

    def flow_caps(self, band: BandView, capacity: float) -> Mapping[str, float] | None:
        state = self._state(band)
        caps, light = state.caps, state.light
        caps.clear()
        light.clear()
        now = time.monotonic()
        seen = state.seen
        horizon = now - self._window
        for fid in [f for f, t in seen.items() if t < horizon]:
            del seen[fid]
        backlog = {flow.key.id: len(flow) for flow in band.flows()}
        queued = list(backlog)
        active = {*queued, *band.inflight_flows(), *seen}
        rates = state.rates
        for fid in [f for f in rates if f not in active]:
            del rates[fid]  # an idle flow's rate starts again from zero
        k = len(active)
        if k <= 1 or capacity <= 0.0:
            return None
        # demand: the rate served plus the backlog spread over the window (a flood's queue counts)
        tau = self._tau
        demand = {fid: self._rate(state, fid, now) + backlog.get(fid, 0) / tau for fid in active}
        fair_demand = sum(demand.values()) / k
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
            if demand[fid] < fair_demand:
                light.add(fid)  # asks for less than its share of the band's rate: no cap, and first
                continue
            rest = capacity - (claims - claim[fid])
            caps[fid] = rest if rest > share else share
        return caps

    def _rate(self, state: _State, fid: str, now: float) -> float:
        """``fid``'s dispatches per second, decayed exponentially over ``rateWindowSeconds``."""
        value, at = state.rates.get(fid, (0.0, now))
        return value * math.exp((at - now) / self._tau)

    def pick(self, band: BandView) -> FlowView | None:
        state = self._state(band)
        caps, light = state.caps, state.light
        last = state.last
        first: FlowView | None = None  # the smallest eligible id (where the rotation wraps to)
        after: FlowView | None = None  # the smallest eligible id greater than the last pick
        for flow in band.flows():
            fid = flow.key.id
            if light and fid not in light:
                continue  # flows served under their rate share go first
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
        state = self._state(band)
        now = time.monotonic()
        fid = item.key.id
        state.rates[fid] = (self._rate(state, fid, now) + 1.0 / self._tau, now)
        if self._window > 0.0:
            state.seen[fid] = now
