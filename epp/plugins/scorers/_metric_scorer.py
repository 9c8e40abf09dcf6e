"""The rule shared by scorers that read scraped model-server metrics: unknown metrics score neutrally.

An endpoint's metrics are *unknown* when they were never scraped or are older than
``--metrics-staleness-threshold`` (``Metrics.known``: the scraper sets ``fresh_until``), whatever
the reason (a ``/metrics`` that fails, hangs or returns garbage, a new endpoint). Its values are
then zeros or old numbers, and an idle-looking endpoint would attract most of the traffic.

A ``MetricScorer`` implements ``score_known`` and is called only with the candidates whose metrics
are known (min-max normalisations run over them alone, so unknown zeros do not stretch the scale).
Every other candidate gets the *neutral* score: the mean of the known candidates' scores (clamped
to [0, 1] like the profile does), never above the best of them, exactly their common value when
they are all equal. An endpoint with unknown metrics thus ranks like an average endpoint: with
max-score picking it never beats the best known endpoint on metrics and wins only ties (at most
its fair share when all are equal). Because the mean is linear, its weighted sum over several
metric scorers is the mean of the known endpoints' sums, so the combination cannot favour it
either. When no candidate has known metrics every candidate scores ``NEUTRAL`` (0.5): the scorer
then does not discriminate. Scorers fed by the EPP's own in-flight counts (``active-request-scorer``,
``token-load-scorer``) and affinity scorers are not metric scorers and keep scoring every endpoint.

Cost: one ``time.monotonic()`` and one comparison per candidate; the all-known case calls
``score_known`` with the candidate list itself.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer

NEUTRAL = 0.5


class MetricScorer(Scorer, abc.ABC):
    """A scorer over scraped metrics; subclasses implement ``score_known``."""

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        now = time.monotonic()
        for e in endpoints:
            if e.metrics.fresh_until < now:
                break
        else:  # the common case: every candidate's metrics are known
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
