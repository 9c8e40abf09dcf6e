"""``running-requests-size-scorer``: prefer endpoints running fewer requests."""

from __future__ import annotations

from operator import attrgetter

from epp.framework import CycleState, Endpoint, LLMRequest, register
from epp.framework.score_column import ScoreColumn
from epp.plugins.scorers._metric_scorer import MetricScorer, MinMaxColumn
from epp.plugins.scorers.queue import min_max_scores

_RUNNING = attrgetter("metrics.running_requests_size")


@register
class RunningRequestsSizeScorer(MetricScorer):
    type_name = "running-requests-size-scorer"
    category = "Distribution"
    metrics_only = True

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        return min_max_scores(list(map(_RUNNING, endpoints)))

    def score_column(self, endpoints: list[Endpoint]) -> ScoreColumn | None:
        return MinMaxColumn(_RUNNING, endpoints) if self.scores_as(RunningRequestsSizeScorer) else None
