"""The rule shared by the multicluster metric scorers: score peer clusters on a pool-aggregate
attribute that ``multicluster-metrics-extractor`` wrote; a cluster without it gets the neutral score
of the others (as unknown metrics do)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer, Stability
from epp.plugins.scorers._metric_scorer import NEUTRAL, neutral_score


class ClusterAttributeScorer(Scorer, abc.ABC):
    stability = Stability.ALPHA
    category = "Distribution"
    attribute = ""

    @abc.abstractmethod
    def rule(self, values: list[float]) -> list[float]:
        """Scores of the known attribute values."""

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        key = self.attribute
        values = [e.attributes.get(key) for e in endpoints]
        known = [float(v) for v in values if isinstance(v, int | float)]
        if not known:
            return [NEUTRAL] * len(endpoints)
        scores = self.rule(known)
        if len(known) == len(values):
            return scores
        neutral = neutral_score(scores)
        it = iter(scores)
        return [next(it) if isinstance(v, int | float) else neutral for v in values]
