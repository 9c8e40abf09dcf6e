"""``global-strict-fairness-policy``: the band's best head item goes next, whatever its flow.

The default fairness policy. It ignores flow boundaries: the band behaves as one queue ordered by
its ordering policy.
"""

from __future__ import annotations

from epp.framework import BandView, FairnessPolicy, FlowView, register


@register
class GlobalStrictFairnessPolicy(FairnessPolicy):
    """Picks the flow whose head has the smallest ``(sort_key, seq)`` across the band."""

    type_name = "global-strict-fairness-policy"

    def pick(self, band: BandView) -> FlowView | None:
        best: FlowView | None = None
        best_key: tuple[tuple[float, ...], int] | None = None
        for flow in band.flows():
            head = flow.peek()
            key = (head.sort_key, head.seq)
            if best_key is None or key < best_key:
                best, best_key = flow, key
        return best
