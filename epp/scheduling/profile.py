"""A scheduling profile: filters, then weighted scorers, then one picker."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.framework.endpoint import Endpoint
from epp.framework.errors import FiltersDrainedError, SchedulingError
from epp.framework.interfaces import Filter, Picker, Scorer
from epp.framework.request import LLMRequest
from epp.framework.results import CycleState, ProfileRunResult, ScoredEndpoint
from epp.scheduling.bulk import BulkScoring
from epp.scheduling.data_scope import scope_of
from epp.scheduling.decision import DECISION_KEY, Recorded
from epp.scheduling.metrics_age import MetricsAge
from epp.scheduling.scorer_metrics import ScorerMetrics

# (extension_point, plugin, seconds) -> None; set by the server to feed the plugin-duration metric.
PluginTimer = Callable[[str, object, float], None]
# Cycle-state key of the profiles' explanations (``SchedulerProfile.explain``): a list of dicts.
EXPLANATIONS_KEY = "epp.scheduling.explanations"
_TOP = 3  # endpoints shown per scorer in an explanation


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float = 1.0


@dataclass(slots=True)
class SchedulerProfile:
    """Filters run in order, each on the previous output; the first empty output fails the profile.

    Each scorer's scores are clamped to [0, 1], multiplied by its weight and summed per endpoint (no
    division by the sum of weights: argmax and weighted-random picks do not change under a uniform
    scale). The picker receives the scored endpoints in candidate order; an empty pick fails too.
    Unless a request is traced or explained, the sums come from ``BulkScoring`` (the same numbers,
    with the plugins' bulk paths and scores reused while the candidates' metrics are unchanged).
    """

    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    picker: Picker | None = None
    timer: PluginTimer | None = None
    # With --tracing: an ``epp.tracing.ProfileTracer`` (spans per phase and scorer); None when off.
    tracer: Any = None
    record_scores: bool = False  # set ProfileRunResult.scores (--emit-endpoint-scores)
    explain: bool = False  # --log-level=debug: record why it picked what it picked (EXPLANATIONS_KEY)
    decide: bool = False  # record each run's Decision (DECISION_KEY): explainable decisions
    bulk: bool = True  # False: always the per-endpoint path (the bulk path's reference in tests)
    _metrics: ScorerMetrics | None = None  # bound on the first run (the scorers are set by then)
    _age: MetricsAge | None = field(default=None, init=False, repr=False, compare=False)
    _bulk: BulkScoring = field(default_factory=BulkScoring, init=False, repr=False, compare=False)

    def run(self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint]) -> ProfileRunResult:
        """Run the profile; raises ``SchedulingError`` when it cannot pick an endpoint."""
        tracer = self.tracer
        if tracer is not None:
            spans = tracer.spans()  # None unless this request is traced (sampled)
            if spans is not None:
                with spans:
                    spans.profile(self.name)
                    return self._run(cycle, request, candidates, spans)
        if self.explain:
            return self._explained(cycle, request, candidates)
        return self._run(cycle, request, candidates, None)

    def _explained(
        self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint]
    ) -> ProfileRunResult:
        """``_run`` with its decision recorded in the cycle state: candidates, each scorer's best
        endpoints, the pick or the error (one entry per profile run)."""
        top: dict[str, list[tuple[str, float]]] = {}
        entry: dict[str, Any] = {"profile": self.name, "candidates": len(candidates), "scorers": top}
        cycle.setdefault(EXPLANATIONS_KEY, []).append(entry)
        try:
            result = self._run(cycle, request, candidates, None, top)
        except Exception as exc:
            entry["error"] = str(exc)
            raise
        entry["picked"] = [e.metadata.name for e in result.target_endpoints]
        return result

    def _record_scorers(self, rows: list[Any], endpoints: list[Endpoint], picked: Endpoint) -> None:
        metrics = self._metrics
        if metrics is None or metrics.size != len(rows):  # bound on the first run, again if scorers change
            scorers = [(ws.scorer.type_name, ws.scorer.name) for ws in self.scorers]
            metrics = self._metrics = ScorerMetrics(self.name, scorers)
        try:
            i = endpoints.index(picked)  # Endpoint compares by identity: a C-level walk
        except ValueError:
            return
        metrics.record([ws.weight for ws in self.scorers], rows, i)

    def _run(
        self,
        cycle: CycleState,
        request: LLMRequest,
        candidates: list[Endpoint],
        spans: Any,
        top: dict[str, list[tuple[str, float]]] | None = None,
    ) -> ProfileRunResult:
        timer = self.timer
        endpoints = candidates
        if spans is not None:
            spans.filters(request, candidates)
        for f in self.filters:
            t0 = time.perf_counter() if timer else 0.0
            cycle.scope = scope_of("Filter", f)
            try:
                endpoints = f.filter(cycle, request, endpoints)
            finally:
                cycle.scope = None
            if timer:
                timer("Filter", f, time.perf_counter() - t0)
            if not endpoints:
                raise FiltersDrainedError(f"no endpoints available for the given request (filter '{f.name}')")
        if spans is not None:
            spans.filters_done(endpoints)

        if self.picker is None:
            raise SchedulingError(f"profile '{self.name}' has no picker")
        if spans is None and top is None and self.bulk and self._bulk.usable(self.scorers):
            rows: list[Sequence[float] | None] = []  # each scorer's scores (None: weight 0, not called)
            totals = self._bulk.totals(self.scorers, cycle, request, endpoints, timer, rows)
            t0 = time.perf_counter() if timer else 0.0
            result = self.picker.pick_totals(cycle, request, endpoints, totals)
            if result is None:
                scored = [ScoredEndpoint(e, s) for e, s in zip(endpoints, totals, strict=True)]
                result = self.picker.pick(cycle, request, scored)
            if timer:
                timer("Picker", self.picker, time.perf_counter() - t0)
            return self._finish(cycle, result, endpoints, totals, rows)

        n = len(endpoints)
        totals = [0.0] * n
        rows = []
        if spans is not None:
            spans.scoring(request, len(self.scorers), endpoints)
        for ws in self.scorers:
            t0 = time.perf_counter() if timer else 0.0
            if spans is not None:
                spans.scorer(ws.scorer.type_name, ws.scorer.name, ws.weight, endpoints)
            cycle.scope = scope_of("Scorer", ws.scorer)
            try:
                scores = ws.scorer.score(cycle, request, endpoints)
            finally:
                cycle.scope = None
            if spans is not None:
                spans.scorer_done(scores)
            if top is not None:
                ranked = sorted(zip(scores, (e.metadata.name for e in endpoints), strict=False), reverse=True)
                top[ws.scorer.name] = [(name, round(float(v), 4)) for v, name in ranked[:_TOP]]
            if timer:
                timer("Scorer", ws.scorer, time.perf_counter() - t0)
            if len(scores) != n:
                raise SchedulingError(
                    f"scorer '{ws.scorer.name}' returned {len(scores)} scores for {n} endpoints"
                )
            rows.append(tuple(scores))  # as scored: a scorer may reuse its list
            w = ws.weight
            for i, s in enumerate(scores):
                if s > 0.0:
                    totals[i] += (1.0 if s > 1.0 else s) * w
        if spans is not None:
            spans.leave()  # llm_d.epp.scoring

        t0 = time.perf_counter() if timer else 0.0
        scored = [ScoredEndpoint(e, s) for e, s in zip(endpoints, totals, strict=True)]
        if spans is not None:
            spans.picker(request, scored)
        result = self.picker.pick(cycle, request, scored)
        if spans is not None:
            spans.leave()  # pick_endpoints
        if timer:
            timer("Picker", self.picker, time.perf_counter() - t0)
        return self._finish(cycle, result, endpoints, totals, rows)

    def _finish(
        self,
        cycle: CycleState,
        result: ProfileRunResult,
        endpoints: list[Endpoint],
        totals: list[float],
        rows: list[Sequence[float] | None],
    ) -> ProfileRunResult:
        """``rows[j]``: scorer ``j``'s unweighted scores of ``endpoints`` (None: not called, weight 0)."""
        assert self.picker is not None
        if not result.target_endpoints:
            raise SchedulingError(f"picker '{self.picker.name}' returned no endpoint")
        if self.decide:  # references only: the explanation is built when something shows it
            recorded = Recorded(self.name, self.scorers, rows, endpoints, totals, result.target_endpoints)
            cycle.setdefault(DECISION_KEY, []).append(recorded)
        if rows:
            self._record_scorers(rows, endpoints, result.target_endpoints[0])
        age = self._age
        if age is None:
            age = self._age = MetricsAge(self.name)
        age.record(result.target_endpoints[0])
        if self.record_scores and result.scores is None:
            by_id = {id(e): s for e, s in zip(endpoints, totals, strict=True)}
            result.scores = [by_id.get(id(e), 0.0) for e in result.target_endpoints]
        return result
