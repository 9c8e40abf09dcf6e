"""``weighted-random-picker``: endpoints drawn at random with probability proportional to score (A-Res)."""

from __future__ import annotations

import heapq
import math
import sys

from epp.framework import CycleState, LLMRequest, Picker, ProfileRunResult, ScoredEndpoint, register
from epp.plugins.pickers._common import PickerParams, rng

_MIN_U = 1e-10
_NO_KEY = -math.inf  # the key of a non-positive score: below every positive score's key
_LOWEST_KEY = -sys.float_info.max  # a subnormal score's key would overflow to -inf


def _key(score: float) -> float:
    """``log(U ** (1 / score))``: the A-Res key in log space.

    Same order as ``U ** (1 / score)``, but a small positive score cannot underflow to the key of a
    zero score.
    """
    if score <= 0.0:
        return _NO_KEY
    u = rng.random()
    return max(math.log(u if u != 0.0 else _MIN_U) / score, _LOWEST_KEY)


@register
class WeightedRandomPicker(Picker):
    type_name = "weighted-random-picker"
    Params = PickerParams
    params: PickerParams

    def pick(self, cycle: CycleState, request: LLMRequest, scored: list[ScoredEndpoint]) -> ProfileRunResult:
        k = min(self.params.k, len(scored))
        if not any(s.score > 0.0 for s in scored):
            return ProfileRunResult([s.endpoint for s in rng.sample(scored, k)])
        if k == 1:
            best = scored[0]
            best_key = _NO_KEY
            for s in scored:
                key = _key(s.score)
                if key > best_key:
                    best, best_key = s, key
            return ProfileRunResult([best.endpoint])
        keys = [_key(s.score) for s in scored]
        top = heapq.nlargest(k, range(len(scored)), key=keys.__getitem__)
        return ProfileRunResult([scored[i].endpoint for i in top])
