"""A profile's scoring in bulk: the weighted sums ``SchedulerProfile`` defines, computed with
C-level passes over the candidates and reused across requests where nothing they read changed.

Per scorer, in profile order:

- ``metrics_only`` scorers: their clamped, weighted scores are a column kept while the candidates
  are the same objects, their ``Metrics`` objects are the same (or equal) and all are still fresh;
  so are the sums of the leading run of such scorers (the default profile's queue and KV scorers).
- scorers with a ``score_grouped`` answer (few distinct scores) add through a label -> weighted
  score table, in C.
- any other scorer is called as in the per-endpoint path.
- a weight of 0 skips a scorer with a bulk path (its sums would not move).

Additions happen in the same order as the per-endpoint path, so the sums are the same floats.
Weights that are not finite use the per-endpoint path.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

from epp.framework.candidates import FRESH_UNTIL_MIN_KEY, CandidateMemo
from epp.framework.endpoint import Endpoint, Metrics
from epp.framework.errors import SchedulingError
from epp.framework.interfaces import Scorer
from epp.framework.request import LLMRequest
from epp.framework.results import CycleState
from epp.scheduling.data_scope import scope_of

_METRICS = operator.attrgetter("metrics")
_FRESH_UNTIL = operator.attrgetter("fresh_until")
_ADD = operator.add
_IS = operator.is_
_MUL = operator.mul
Timer = Callable[[str, object, float], None]


def has_grouped(scorer: Scorer) -> bool:
    """True when the scorer's class implements ``score_grouped``."""
    return type(scorer).score_grouped is not Scorer.score_grouped


class _LabelTable(dict[Any, float]):
    """label -> its score clamped to [0, 1] times the weight, computed on a label's first lookup
    (``__missing__``), so the lookups of the others stay in C."""

    __slots__ = ("_score_of", "_weight")

    def __init__(self, score_of: Callable[[Any], float], weight: float) -> None:
        super().__init__()
        self._score_of = score_of
        self._weight = weight

    def __missing__(self, label: Any) -> float:
        s = self._score_of(label)
        v = self[label] = (1.0 if s > 1.0 else s) * self._weight if s > 0.0 else 0.0
        return v


class _RawTable(dict[Any, float]):
    """label -> its score as the scorer gives it, asked once per distinct label."""

    __slots__ = ("_score_of",)

    def __init__(self, score_of: Callable[[Any], float]) -> None:
        super().__init__()
        self._score_of = score_of

    def __missing__(self, label: Any) -> float:
        v = self[label] = self._score_of(label)
        return v


class BulkScoring:
    """One profile's reusable state: the last candidates, their metrics, the columns and sums."""

    __slots__ = ("_columns", "_fresh_min", "_lead", "_lead_len", "_memo", "_metrics", "_raw", "_weights")

    def __init__(self) -> None:
        self._memo = CandidateMemo()
        self._metrics: list[Metrics] = []
        self._fresh_min = -math.inf
        self._columns: dict[int, list[float]] = {}
        self._raw: dict[int, Sequence[float]] = {}  # a kept column's scores as the scorer gave them
        self._lead: list[float] | None = None
        self._lead_len = 0
        self._weights: tuple[tuple[Scorer, float], ...] = ()

    def usable(self, scorers: Sequence[Any]) -> bool:
        return all(math.isfinite(ws.weight) for ws in scorers)

    def _check(
        self, scorers: Sequence[Any], cycle: CycleState, endpoints: list[Endpoint], now: float
    ) -> None:
        """Drop what was kept unless the scorers, candidates and metrics are as before and fresh."""
        weights = tuple((ws.scorer, ws.weight) for ws in scorers)
        same = self._memo.update(endpoints) and weights == self._weights
        if same and now <= self._fresh_min and all(map(_IS, map(_METRICS, endpoints), self._metrics)):
            return  # the same Metrics objects (scrapes replace them whole): nothing to redo
        metrics = list(map(_METRICS, endpoints))
        if same and now <= self._fresh_min and metrics == self._metrics:
            return  # new objects with equal values
        self._weights = weights
        self._metrics = metrics
        self._fresh_min = min(map(_FRESH_UNTIL, metrics), default=math.inf)
        cycle[FRESH_UNTIL_MIN_KEY] = (endpoints, self._fresh_min)  # the metric scorers' check
        self._columns = {}
        self._raw = {}
        self._lead = None
        lead = 0
        for scorer, _ in weights:
            if not scorer.metrics_only:
                break
            lead += 1
        self._lead_len = lead

    def totals(
        self,
        scorers: Sequence[Any],
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[Endpoint],
        timer: Timer | None,
        rows: list[Sequence[float] | None],
    ) -> list[float]:
        """The weighted sums; appends each scorer's scores to ``rows`` in profile order (the kept ones
        for kept columns; None for a scorer of weight 0 that was not called)."""
        n = len(endpoints)
        self._check(scorers, cycle, endpoints, time.monotonic())
        lead_len = self._lead_len
        start = 0
        totals: list[float] | None = None
        shared = False  # totals is the kept lead sums: replace, never change in place
        if lead_len and self._lead is not None:
            totals = self._lead
            shared = True
            start = lead_len
            if timer:
                for ws in scorers[:lead_len]:
                    timer("Scorer", ws.scorer, 0.0)
            rows.extend(self._raw.get(j) for j in range(lead_len))
        columns = self._columns
        raw = self._raw
        scores: Sequence[float]
        for j in range(start, len(scorers)):
            ws = scorers[j]
            scorer, w = ws.scorer, ws.weight
            t0 = time.perf_counter() if timer else 0.0
            if scorer.metrics_only:
                if w != 0.0:
                    col = columns.get(j)
                    if col is None:
                        scores = raw[j] = tuple(_call(scorer, cycle, request, endpoints, n))
                        col = columns[j] = add_dense(None, scores, w, n)
                    totals = list(col) if totals is None else list(map(_ADD, totals, col))
                    shared = False
                rows.append(raw.get(j))
            elif has_grouped(scorer):
                if w != 0.0:
                    cycle.scope = scope_of("Scorer", scorer)
                    try:
                        grouped = scorer.score_grouped(cycle, request, endpoints)
                    finally:
                        cycle.scope = None
                    if grouped is None:
                        scores = tuple(_call(scorer, cycle, request, endpoints, n))
                        totals = add_dense(_own(totals, shared), scores, w, n)
                        shared = False
                    else:
                        labels = list(grouped[0])
                        if len(labels) != n:
                            raise SchedulingError(
                                f"scorer '{scorer.name}' gave {len(labels)} labels for {n} endpoints"
                            )
                        lookup = _RawTable(grouped[1]).__getitem__
                        scores = list(map(lookup, labels))
                        weighted = map(_LabelTable(lookup, w).__getitem__, labels)
                        totals = list(weighted) if totals is None else list(map(_ADD, totals, weighted))
                        shared = False
                    rows.append(scores)
                else:
                    rows.append(None)
            else:
                scores = tuple(_call(scorer, cycle, request, endpoints, n))
                totals = add_dense(_own(totals, shared), scores, w, n)
                shared = False
                rows.append(scores)
            if timer:
                timer("Scorer", scorer, time.perf_counter() - t0)
            if j == lead_len - 1:
                if totals is None:
                    totals = [0.0] * n
                self._lead = totals
                shared = True
        if totals is None:
            return [0.0] * n
        return list(totals) if shared else totals  # the picker gets its own list


def _call(
    scorer: Scorer, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint], n: int
) -> Sequence[float]:
    cycle.scope = scope_of("Scorer", scorer)
    try:
        scores = scorer.score(cycle, request, endpoints)
    finally:
        cycle.scope = None
    if len(scores) != n:
        raise SchedulingError(f"scorer '{scorer.name}' returned {len(scores)} scores for {n} endpoints")
    return scores


def _own(totals: list[float] | None, shared: bool) -> list[float] | None:
    return list(totals) if shared and totals is not None else totals


def add_dense(totals: list[float] | None, scores: Sequence[float], w: float, n: int) -> list[float]:
    """``totals`` (None = zeros) plus each score clamped to [0, 1] times ``w``, where it is above 0.

    Scores already in [0, 1] (checked in C: no NaN, none out of range) take C-level passes: a
    score of 0.0 then adds ``0.0 * w``, which leaves every sum as it was."""
    if n and min(scores) >= 0.0 and max(scores) <= 1.0 and (total := sum(scores)) == total:
        col = map(_MUL, scores, repeat(w, n))
        return list(col) if totals is None else list(map(_ADD, totals, col))
    if totals is None:
        totals = [0.0] * n
    for i, s in enumerate(scores):
        if s > 0.0:
            totals[i] += (1.0 if s > 1.0 else s) * w
    return totals
