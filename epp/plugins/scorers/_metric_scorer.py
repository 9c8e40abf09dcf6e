"""The rule shared by scorers that read scraped model-server metrics: unknown metrics score neutrally.

Only candidates whose metrics are known are scored; every other one gets the mean of their scores.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import sub, truediv
from typing import Any

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer
from epp.framework.candidates import fresh_until_min
from epp.framework.score_column import PATCHED, REPLACED, ScoreColumn

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

    def scores_as(self, cls: type[MetricScorer]) -> bool:
        """True when this scorer scores as ``cls`` does (a subclass may override ``score`` or
        ``score_known``: then a column of ``cls`` would not give its scores)."""
        t = type(self)
        return t.score is MetricScorer.score and t.score_known is cls.score_known

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


class MinMaxColumn(ScoreColumn):
    """``(hi - v) / (hi - lo)`` of one metric per candidate (``min_max_scores``), patched in place
    of the changed positions while the range stays the same; the range is read again only when a
    changed value sat on it or left it."""

    __slots__ = ("_get", "_hi", "_lo", "_values", "scores")

    def __init__(self, get: Callable[[Endpoint], Any], endpoints: Sequence[Endpoint]) -> None:
        self._get = get
        self._values = values = list(map(get, endpoints))
        self._lo = min(values, default=0)
        self._hi = max(values, default=0)
        self.scores = _min_max(values, self._lo, self._hi)

    @property
    def top(self) -> float | None:  # type: ignore[override]
        return 1.0 if self.scores else None

    def update(self, endpoints: Sequence[Endpoint], changed: Sequence[int]) -> int:
        values, get, lo, hi = self._values, self._get, self._lo, self._hi
        edge = False
        news = []
        for i in changed:
            old = values[i]
            v = values[i] = get(endpoints[i])
            news.append(v)
            if old in (lo, hi) or not lo <= v <= hi:
                edge = True
        if edge:
            lo2, hi2 = min(values, default=0), max(values, default=0)
            if lo2 != lo or hi2 != hi:
                self._lo, self._hi = lo2, hi2
                self.scores = _min_max(values, lo2, hi2)
                return REPLACED
        scores = list(self.scores)
        if hi != lo:
            span = hi - lo
            for i, v in zip(changed, news, strict=True):
                scores[i] = (hi - v) / span
        self.scores = scores
        return PATCHED


class ComplementColumn(ScoreColumn):
    """``1.0 - v`` of one metric per candidate, patched at the changed positions."""

    __slots__ = ("_get", "_lo", "_values", "scores")

    def __init__(self, get: Callable[[Endpoint], Any], endpoints: Sequence[Endpoint]) -> None:
        self._get = get
        self._values = values = list(map(get, endpoints))
        n = len(values)
        self.scores = list(map(sub, repeat(1.0, n), values))
        self._lo = min(values, default=None)

    @property
    def top(self) -> float | None:  # type: ignore[override]
        lo = self._lo
        return None if lo is None or lo != lo else 1.0 - lo

    def update(self, endpoints: Sequence[Endpoint], changed: Sequence[int]) -> int:
        values, get, lo = self._values, self._get, self._lo
        scores = list(self.scores)
        edge = False
        for i in changed:
            old = values[i]
            v = values[i] = get(endpoints[i])
            scores[i] = 1.0 - v
            if lo is None or old == lo or v < lo or v != v:
                edge = True
        if edge:
            self._lo = min(values, default=None)
        self.scores = scores
        return PATCHED


def _min_max(values: list[Any], lo: Any, hi: Any) -> list[float]:
    """``min_max_scores`` with the range already read."""
    n = len(values)
    if hi == lo:
        return [1.0] * n
    return list(map(truediv, map(sub, repeat(hi, n), values), repeat(hi - lo, n)))
