"""``max-score-picker``: the highest total score wins, ties broken at random."""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, LLMRequest, Picker, ProfileRunResult, ScoredEndpoint, register
from epp.framework.sparse import TOTALS_BLOCK
from epp.plugins.pickers._common import PickerParams, rng

_BLOCK = TOTALS_BLOCK  # totals examined per C-level max in pick_totals


@register
class MaxScorePicker(Picker):
    type_name = "max-score-picker"
    Params = PickerParams
    params: PickerParams

    def pick(self, cycle: CycleState, request: LLMRequest, scored: list[ScoredEndpoint]) -> ProfileRunResult:
        k = self.params.k
        if k == 1:  # one pass; reservoir sampling picks uniformly among the tied best
            best = None
            best_score = float("-inf")
            ties = 0
            for s in scored:
                if s.score > best_score:
                    best, best_score, ties = s, s.score, 1
                elif s.score == best_score:
                    ties += 1
                    if rng.random() * ties < 1.0:
                        best = s
            return ProfileRunResult([best.endpoint] if best is not None else [])
        shuffled = list(scored)
        rng.shuffle(shuffled)
        shuffled.sort(key=lambda s: s.score, reverse=True)
        return ProfileRunResult([s.endpoint for s in shuffled[:k]])

    def pick_totals(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint], totals: list[float]
    ) -> ProfileRunResult | None:
        """``pick`` without the scored objects: the same draws from ``rng`` in the same order."""
        k = self.params.k
        if k == 1:
            # The reservoir only acts where a score reaches the best so far (a new best or a tie):
            # a block whose maximum (taken in C, or bounded by the totals' ``bounds``) is below
            # it is skipped whole.
            best = -1
            best_score = float("-inf")
            ties = 0
            n = len(totals)
            bounds = getattr(totals, "bounds", None)
            for lo in range(0, n, _BLOCK):
                if bounds is not None:
                    if bounds[lo // _BLOCK] < best_score:
                        continue
                    block = totals[lo : lo + _BLOCK]
                else:
                    block = totals[lo : lo + _BLOCK]
                    if max(block) < best_score:
                        continue
                for i, s in enumerate(block, lo):
                    if s > best_score:
                        best, best_score, ties = i, s, 1
                    elif s == best_score:
                        ties += 1
                        if rng.random() * ties < 1.0:
                            best = i
            return ProfileRunResult([endpoints[best]] if best >= 0 else [])
        order = list(range(len(totals)))
        rng.shuffle(order)  # the same permutation as shuffling the scored list of that length
        order.sort(key=totals.__getitem__, reverse=True)
        return ProfileRunResult([endpoints[i] for i in order[:k]])
