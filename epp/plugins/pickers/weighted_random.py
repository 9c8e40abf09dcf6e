"""``weighted-random-picker``: pick endpoints at random with probability proportional to score.

Type: ``weighted-random-picker``. Parameters: ``maxNumOfEndpoints`` (int, default 1; <= 0 means 1).

Algorithm (A-Res weighted sampling without replacement, Efraimidis & Spirakis):

* no candidate has a score > 0 → behave as ``random-picker`` (k distinct endpoints uniformly);
* otherwise each candidate gets a key: ``U ** (1 / score)`` with U uniform in [0, 1) and 0 replaced
  by 1e-10, or key 0 when ``score <= 0``; the k largest keys win, largest first.

With k = 1 the probability of picking an endpoint is its share of the total score, and scaling every
score by the same factor changes nothing. When k exceeds the number of positive scores, zero-score
endpoints fill the remaining places in candidate order (the reference's unstable sort leaves that
order unspecified).

Implementation note: epp ranks by ``log(U) / score``, a strictly increasing function of the
reference's ``U ** (1 / score)``, so the order (and thus the distribution) is the same, but a small
positive score cannot underflow to key 0 and tie with the zero-score endpoints (in the reference,
``0.5 ** (1 / 0.001)`` is already 0.0 and such an endpoint can lose to a zero-score one).
"""

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
    """``log(U ** (1 / score))``: the A-Res key in log space."""
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
