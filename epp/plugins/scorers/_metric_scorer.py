"""The rule shared by scorers that read scraped model-server metrics: unknown metrics score neutrally.

Only candidates whose metrics are known are scored; every other one gets the mean of their scores.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer
from epp.framework.candidates import fresh_until_min

NEUTRAL = 0.5


class MetricScorer(Scorer, abc.ABC):
    """A scorer over scraped metrics; subclasses implement ``score_known``.

    ``score_known`` sees only the candidates whose metrics are known (so unknown zeros do not stretch a
    min-max scale); the others get ``neutral_score`` of the known scores. When all are known the
    candidate list itself is passed.
    """

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        now = time.monotonic()
        if fresh_until_min(cycle, endpoints) >= now:  # the common case: every candidate known
            return self.score_known(cycle, request, endpoints)
        mask = [now <= e.metrics.fresh_until for e in endpoints]
        known = [e for e, k in zip(endpoints, mask, strict=True) if k]
        if not known:
            return [NEUTRAL] * len(endpoints)
        scores = self.score_known(cycle, request, known)
        if len(scores) != len(known):
            return scores  # the profile reports the length mismatch
        neutral = neutral_score(scores)
        it = iter(scores)
        return [next(it) if k else neutral for k in mask]

    @abc.abstractmethod
    def score_known(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> Sequence[float]:
        """Scores of ``endpoints``, all of which have known metrics."""


def neutral_score(scores: Sequence[float]) -> float:
    """The mean of ``scores`` clamped to [0, 1], at most their maximum; NEUTRAL for none."""
    if not scores:
        return NEUTRAL
    clamped = [0.0 if s < 0.0 else 1.0 if s > 1.0 else s for s in scores]
    lo, hi = min(clamped), max(clamped)
    if lo == hi:
        return hi
    mean = sum(clamped) / len(clamped)
    return mean if mean < hi else hi
