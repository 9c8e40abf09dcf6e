"""``round-robin-fairness-policy``: the flows of a band take turns, one dispatch each.

Flows are visited in the order of their fairness ids; a per-band cursor remembers the last flow
picked, so flows that come and go do not reset the rotation. It asks flow control to balance the
band's in-flight requests as well (``share_in_flight``).
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import BandView, FairnessPolicy, FlowView, register


@dataclass(slots=True)
class _Cursor:
    last: str | None = None  # fairness id of the flow picked last


@register
class RoundRobinFairnessPolicy(FairnessPolicy):
    """Picks the non-empty flow whose id follows the last pick's, wrapping around."""

    type_name = "round-robin-fairness-policy"
    share_in_flight = True  # turns, plus the controller's in-flight share balancing

    def new_state(self) -> _Cursor:
        return _Cursor()

    def pick(self, band: BandView) -> FlowView | None:
        cursor = band.policy_state
        if not isinstance(cursor, _Cursor):
            raise TypeError(f"{self.typed_name}: band state is {type(cursor).__name__}, not its cursor")
        last = cursor.last
        first: FlowView | None = None  # the smallest id (where the rotation wraps to)
        after: FlowView | None = None  # the smallest id greater than the last pick
        for flow in band.flows():
            fid = flow.key.id
            if first is None or fid < first.key.id:
                first = flow
            if last is not None and fid > last and (after is None or fid < after.key.id):
                after = flow
        chosen = after if after is not None else first
        cursor.last = chosen.key.id if chosen is not None else None
        return chosen
