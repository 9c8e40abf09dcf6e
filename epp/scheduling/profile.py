"""A scheduling profile: filters, then weighted scorers, then one picker."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from epp.framework.endpoint import Endpoint
from epp.framework.errors import SchedulingError
from epp.framework.interfaces import Filter, Picker, Scorer
from epp.framework.request import LLMRequest
from epp.framework.results import CycleState, ProfileRunResult, ScoredEndpoint

# (extension_point, plugin, seconds) -> None; set by the server to feed the plugin-duration metric.
PluginTimer = Callable[[str, object, float], None]


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
    """

    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    picker: Picker | None = None
    timer: PluginTimer | None = None
    # With --tracing: an ``epp.tracing.ProfileTracer`` (spans per phase and scorer); None when off.
    tracer: Any = None

    def run(self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint]) -> ProfileRunResult:
        """Run the profile; raises ``SchedulingError`` when it cannot pick an endpoint."""
        tracer = self.tracer
        if tracer is not None:
            spans = tracer.spans()  # None unless this request is traced (sampled)
            if spans is not None:
                with spans:
                    spans.profile(self.name)
                    return self._run(cycle, request, candidates, spans)
        return self._run(cycle, request, candidates, None)

    def _run(
        self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint], spans: Any
    ) -> ProfileRunResult:
        timer = self.timer
        endpoints = candidates
        if spans is not None:
            spans.filters(request, candidates)
        for f in self.filters:
            t0 = time.perf_counter() if timer else 0.0
            endpoints = f.filter(cycle, request, endpoints)
            if timer:
                timer("Filter", f, time.perf_counter() - t0)
            if not endpoints:
                raise SchedulingError(f"no endpoints available for the given request (filter '{f.name}')")
        if spans is not None:
            spans.filters_done(endpoints)

        n = len(endpoints)
        totals = [0.0] * n
        if spans is not None:
            spans.scoring(request, len(self.scorers), endpoints)
        for ws in self.scorers:
            t0 = time.perf_counter() if timer else 0.0
            if spans is not None:
                spans.scorer(ws.scorer.type_name, ws.scorer.name, ws.weight, endpoints)
            scores = ws.scorer.score(cycle, request, endpoints)
            if spans is not None:
                spans.scorer_done(scores)
            if timer:
                timer("Scorer", ws.scorer, time.perf_counter() - t0)
            if len(scores) != n:
                raise SchedulingError(
                    f"scorer '{ws.scorer.name}' returned {len(scores)} scores for {n} endpoints"
                )
            w = ws.weight
            for i, s in enumerate(scores):
                if s > 0.0:
                    totals[i] += (1.0 if s > 1.0 else s) * w
        if spans is not None:
            spans.leave()  # llm_d.epp.scoring

        if self.picker is None:
            raise SchedulingError(f"profile '{self.name}' has no picker")
        t0 = time.perf_counter() if timer else 0.0
        scored = [ScoredEndpoint(e, s) for e, s in zip(endpoints, totals, strict=True)]
        if spans is not None:
            spans.picker(request, scored)
        result = self.picker.pick(cycle, request, scored)
        if spans is not None:
            spans.leave()  # pick_endpoints
        if timer:
            timer("Picker", self.picker, time.perf_counter() - t0)
        if not result.target_endpoints:
            raise SchedulingError(f"picker '{self.picker.name}' returned no endpoint")
        return result
