"""A profile's scoring in bulk: the weighted sums ``SchedulerProfile`` defines, computed with
C-level passes over the candidates and reused across requests where nothing they read changed.

Per scorer, in profile order:

- ``metrics_only`` scorers: their clamped, weighted scores are a column kept while the candidates
  are the same objects, their ``Metrics`` objects are the same (or equal) and all are still fresh;
  so are the sums of the leading run of such scorers (the default profile's queue and KV scorers).
- scorers with a ``score_grouped`` answer (few distinct scores) add through a label -> weighted
  score table, in C.
- any other scorer gives its ``score_bulk`` answer (scores from state it keeps across requests)
  or is called as in the per-endpoint path.
- a weight of 0 skips a scorer with a bulk path (its sums would not move).

Additions happen in the same order as the per-endpoint path, so the sums are the same floats.
Weights that are not finite use the per-endpoint path.
"""

from __future__ import annotations

import math
import operator
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

from epp.framework.candidates import FRESH_UNTIL_MIN_KEY, CandidateMemo
from epp.framework.endpoint import Endpoint
from epp.framework.errors import SchedulingError
from epp.framework.interfaces import Scorer
from epp.framework.metrics_journal import JOURNAL
from epp.framework.request import LLMRequest
from epp.framework.results import CycleState
from epp.framework.score_column import REBUILD, REPLACED, ScoreColumn
from epp.framework.sparse import TOTALS_BLOCK, SparseLabels, SparseRow, Totals
from epp.scheduling.data_scope import scope_of

_FRESH_UNTIL = operator.attrgetter("metrics.fresh_until")
_ADD = operator.add
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


class _Row(list[float]):
    """A kept column's scores as the scorer gave them, with their maximum when known (``top``)."""

    __slots__ = ("top",)

    def __init__(self, scores: Sequence[float], top: float | None) -> None:
        super().__init__(scores)
        self.top = top


def _weighted(s: float, w: float) -> float:
    """One score's share of a sum, as ``add_dense`` adds it."""
    return (1.0 if s > 1.0 else s) * w if s > 0.0 else 0.0


class BulkScoring:
    """One profile's reusable state: the last candidates, their freshness, the kept columns and
    sums, patched from the metrics journal where a few candidates' metrics changed."""

    __slots__ = (
        "_bases",
        "_cols",
        "_fresh",
        "_fresh_min",
        "_lead",
        "_lead_len",
        "_memo",
        "_raw",
        "_seq",
        "_wcols",
        "_weights",
    )

    def __init__(self) -> None:
        self._memo = CandidateMemo()
        self._seq = -1  # the journal's number the kept state was read at (-1: nothing kept)
        self._fresh: list[float] = []
        self._fresh_min = -math.inf
        self._cols: dict[int, ScoreColumn | None] = {}  # None: no column, the scorer rescored on change
        self._raw: dict[int, _Row] = {}  # a kept column's scores as the scorer gave them
        self._wcols: dict[int, list[float]] = {}  # ... clamped and weighted
        self._lead: list[float] | None = None
        self._lead_len = 0
        self._bases: dict[float, tuple[list[float], list[float]]] = {}  # lead + p, its block bounds
        self._weights: tuple[tuple[Scorer, float], ...] = ()

    def usable(self, scorers: Sequence[Any]) -> bool:
        return all(math.isfinite(ws.weight) for ws in scorers)

    def _check(
        self, scorers: Sequence[Any], cycle: CycleState, endpoints: list[Endpoint], now: float
    ) -> bool:
        """Bring the kept state up to the candidates' metrics (patched from the journal, or dropped);
        True when every candidate is fresh now, so kept columns may be used."""
        weights = tuple((ws.scorer, ws.weight) for ws in scorers)
        if self._memo.update(endpoints) and weights == self._weights and self._seq >= 0:
            seq, changed = JOURNAL.since(self._seq)
            if changed is not None:
                self._seq = seq
                if not changed or self._patch(endpoints, changed):
                    cycle[FRESH_UNTIL_MIN_KEY] = (endpoints, self._fresh_min)
                    return now <= self._fresh_min
        self._weights = weights
        self._seq = JOURNAL.seq  # before reading: a change from now on is patched next time
        self._fresh = list(map(_FRESH_UNTIL, endpoints))
        self._fresh_min = min(self._fresh, default=math.inf)
        cycle[FRESH_UNTIL_MIN_KEY] = (endpoints, self._fresh_min)  # the metric scorers' check
        self._cols = {}
        self._raw = {}
        self._wcols = {}
        self._lead = None
        self._bases = {}
        lead = 0
        for scorer, _ in weights:
            if not scorer.metrics_only:
                break
            lead += 1
        self._lead_len = lead
        return now <= self._fresh_min

    def _patch(self, endpoints: list[Endpoint], changed: list[Endpoint]) -> bool:
        """Follow the changed candidates' metrics in the kept state; False: drop it instead."""
        positions = self._memo.positions()
        get = positions.get
        idx = sorted({i for i in map(get, changed) if i is not None})
        if not idx:
            return True
        n = len(endpoints)
        if len(idx) * 4 > n:
            return False  # most changed: building again is cheaper
        fresh, low = self._fresh, self._fresh_min
        again = False
        for i in idx:
            old = fresh[i]
            new = fresh[i] = endpoints[i].metrics.fresh_until
            if new < low:
                low = new
            elif old == low and new > old:  # the least may have risen: read them all again
                again = True
        self._fresh_min = min(fresh, default=math.inf) if again else low
        raw, wcols = self._raw, self._wcols
        replaced = False
        for j, col in self._cols.items():
            how = REBUILD if col is None else col.update(endpoints, idx)
            scores = col.scores if col is not None else ()
            if how == REBUILD or len(scores) != n:
                return False
            raw[j] = _Row(scores, col.top if col is not None else None)
            wc = wcols.get(j)
            if wc is not None:
                w = self._weights[j][1]
                if how == REPLACED:
                    wcols[j] = add_dense(None, scores, w, n)
                    replaced = True
                else:
                    for i in idx:
                        wc[i] = _weighted(scores[i], w)
        lead = self._lead
        if lead is not None:
            kept = [wcols[j] for j in range(self._lead_len) if j in wcols]
            if replaced:  # whole columns moved: the sums again, in C
                total: list[float] | None = None
                for wc in kept:
                    total = list(wc) if total is None else list(map(_ADD, total, wc))
                self._lead = total if total is not None else [0.0] * n
                self._bases = {}
                return True
            for i in idx:
                t = 0.0
                for k, wc in enumerate(kept):
                    t = wc[i] if k == 0 else t + wc[i]
                lead[i] = t
            for p, (base, bounds) in self._bases.items():
                for i in idx:
                    base[i] = lead[i] + p
                for b in {i // TOTALS_BLOCK for i in idx}:
                    bounds[b] = max(base[b * TOTALS_BLOCK : (b + 1) * TOTALS_BLOCK])
        return True

    def _base(self, lead: list[float], p: float) -> tuple[list[float], list[float]]:
        """``lead + p`` per position and its block bounds, kept while the lead is."""
        kept = self._bases.get(p)
        if kept is None:
            base = list(map(_ADD, lead, repeat(p, len(lead))))
            bounds = [max(base[lo : lo + TOTALS_BLOCK]) for lo in range(0, len(base), TOTALS_BLOCK)]
            if len(self._bases) >= 8:
                self._bases.clear()
            kept = self._bases[p] = (base, bounds)
        return kept

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
        keep = self._check(scorers, cycle, endpoints, time.monotonic())
        lead_len = self._lead_len
        start = 0
        totals: list[float] | None = None
        shared = False  # totals is the kept lead sums: replace, never change in place
        bounds: list[float] | None = None  # block bounds of totals, when known
        if keep and lead_len and self._lead is not None:
            totals = self._lead
            shared = True
            start = lead_len
            if timer:
                for ws in scorers[:lead_len]:
                    timer("Scorer", ws.scorer, 0.0)
            rows.extend(self._raw.get(j) for j in range(lead_len))
        raw, wcols = self._raw, self._wcols
        scores: Sequence[float]
        for j in range(start, len(scorers)):
            ws = scorers[j]
            scorer, w = ws.scorer, ws.weight
            t0 = time.perf_counter() if timer else 0.0
            if scorer.metrics_only:
                if w != 0.0:
                    wc = wcols.get(j) if keep else None
                    if wc is None:
                        column = scorer.score_column(endpoints) if keep else None
                        if column is not None and len(column.scores) == n:
                            scores, top = column.scores, column.top
                        else:
                            column, scores, top = (
                                None,
                                tuple(_call(scorer, cycle, request, endpoints, n)),
                                None,
                            )
                        wc = add_dense(None, scores, w, n)
                        if keep:
                            self._cols[j] = column
                            raw[j] = _Row(scores, top)
                            wcols[j] = wc
                        else:
                            rows.append(scores)
                    totals = list(wc) if totals is None else list(map(_ADD, totals, wc))
                    shared = False
                    bounds = None
                    if keep:
                        rows.append(raw[j])
                else:
                    rows.append(None)
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
                        bounds = None
                    elif isinstance(grouped[0], SparseLabels) and grouped[0].n == n:
                        totals, bounds, row = self._sparse(grouped[0], grouped[1], w, totals, shared)
                        shared = False
                        scores = row
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
                        bounds = None
                    rows.append(scores)
                else:
                    rows.append(None)
            else:
                scores = tuple(_call_bulk(scorer, cycle, request, endpoints, n))
                totals = add_dense(_own(totals, shared), scores, w, n)
                shared = False
                bounds = None
                rows.append(scores)
            if timer:
                timer("Scorer", scorer, time.perf_counter() - t0)
            if j == lead_len - 1 and keep:
                if totals is None:
                    totals = [0.0] * n
                self._lead = totals
                shared = True
        if totals is None:
            return [0.0] * n
        if shared:
            return list(totals)  # the picker gets its own list
        return totals if bounds is None else Totals(totals, bounds)

    def _sparse(
        self,
        labels: SparseLabels,
        score_of: Callable[[Any], float],
        w: float,
        totals: list[float] | None,
        shared: bool,
    ) -> tuple[list[float], list[float] | None, SparseRow]:
        """A grouped scorer's sums from ``SparseLabels``: the default label's weighted score added
        to every position (kept with the lead sums), then the exceptions set one by one."""
        lookup = _RawTable(score_of).__getitem__
        table = _LabelTable(lookup, w)
        n = labels.n
        p = table[labels.default]
        exceptions = labels.exceptions
        positions = list(exceptions)
        weighted = map(table.__getitem__, exceptions.values())
        bounds: list[float] | None = None
        if totals is None:
            out = [p] * n
            values = list(weighted)
        else:
            if shared:
                base, kept = self._base(totals, p)
                bounds = list(kept)
                out = list(base)
            else:
                out = list(map(_ADD, totals, repeat(p, n)))
            values = list(map(_ADD, map(totals.__getitem__, positions), weighted))
        deque(map(out.__setitem__, positions, values), maxlen=0)  # scattered in C
        if bounds is not None:
            for i, v in zip(positions, values, strict=True):
                if v > bounds[i // TOTALS_BLOCK]:
                    bounds[i // TOTALS_BLOCK] = v
        return out, bounds, SparseRow(n, labels.default, exceptions, lookup)


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


def _call_bulk(
    scorer: Scorer, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint], n: int
) -> Sequence[float]:
    """The scorer's ``score_bulk`` answer, or its ``score`` when it has none."""
    if type(scorer).score_bulk is Scorer.score_bulk:
        return _call(scorer, cycle, request, endpoints, n)
    cycle.scope = scope_of("Scorer", scorer)
    try:
        scores = scorer.score_bulk(cycle, request, endpoints)
    finally:
        cycle.scope = None
    if scores is None:
        return _call(scorer, cycle, request, endpoints, n)
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
        if w == 1.0 and totals is None:
            return list(scores)  # s * 1.0 is s
        col = map(_MUL, scores, repeat(w, n))
        return list(col) if totals is None else list(map(_ADD, totals, col))
    if totals is None:
        totals = [0.0] * n
    for i, s in enumerate(scores):
        if s > 0.0:
            totals[i] += (1.0 if s > 1.0 else s) * w
    return totals
