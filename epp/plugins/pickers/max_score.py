"""``max-score-picker``: the highest total score wins, ties broken at random."""

from __future__ import annotations

from epp.framework import CycleState, LLMRequest, Picker, ProfileRunResult, ScoredEndpoint, register
from epp.plugins.pickers._common import PickerParams, rng


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
