"""``queue-scorer``: prefer endpoints with shorter waiting queues."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, sub, truediv

from epp.framework import CycleState, Endpoint, LLMRequest, register
from epp.framework.score_column import ScoreColumn
from epp.plugins.scorers._metric_scorer import MetricScorer, MinMaxColumn

_WAITING = attrgetter("metrics.waiting_queue_size")


def min_max_scores(values: Sequence[float]) -> list[float]:
    """``(max - v) / (max - min)`` per value; all 1.0 when the values are equal (shared by scorers)."""
    lo = min(values, default=0)
    hi = max(values, default=0)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    n = len(values)
    return list(map(truediv, map(sub, repeat(hi, n), values), repeat(span, n)))  # (hi - v) / span, in C


@register
class QueueScorer(MetricScorer):
    type_name = "queue-scorer"
    category = "Distribution"
    metrics_only = True

    def score_known(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[float]:
        return min_max_scores(list(map(_WAITING, endpoints)))

    def score_column(self, endpoints: list[Endpoint]) -> ScoreColumn | None:
        return MinMaxColumn(_WAITING, endpoints) if self.scores_as(QueueScorer) else None
