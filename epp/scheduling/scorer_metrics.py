"""Per-scorer decision metrics: what each scorer contributed to the endpoint that was picked.

``llm_d_epp_scorer_picked_score`` is the weighted score a scorer gave the picked endpoint (its
share of the total that decided); ``llm_d_epp_scorer_picks_total`` counts, per scorer, the picks
that went to an endpoint it ranked first (``agreed="true"``) or not. Both are bound once per
scorer instance; the work per request is one pass over each scorer's scores.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp import promlite

_LABELS = ("profile", "plugin_type", "plugin_name")
SCORE_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 3.0, 5.0, 10.0)
PICKED_SCORE = promlite.Histogram(
    "llm_d_epp_scorer_picked_score",
    "[ALPHA] Weighted score each scorer gave the endpoint that was picked (epp).",
    _LABELS,
    buckets=SCORE_BUCKETS,
)
PICKS = promlite.Counter(
    "llm_d_epp_scorer_picks_total",
    "[ALPHA] Picks per scorer: agreed=true when the picked endpoint was that scorer's best (epp).",
    (*_LABELS, "agreed"),
)
promlite.register(PICKED_SCORE, PICKS)


class ScorerMetrics:
    """The bound series of one profile's scorers (in the profile's scorer order)."""

    __slots__ = ("_agreed", "_disagreed", "_score")

    def __init__(self, profile: str, scorers: Sequence[tuple[str, str]]) -> None:
        self._score = [PICKED_SCORE.labels(profile, t, n) for t, n in scorers]
        self._agreed = [PICKS.labels(profile, t, n, "true") for t, n in scorers]
        self._disagreed = [PICKS.labels(profile, t, n, "false") for t, n in scorers]

    @property
    def size(self) -> int:
        return len(self._score)

    def record(self, weights: Sequence[float], scores: Sequence[Sequence[float] | None], picked: int) -> None:
        """``scores[k]``: scorer ``k``'s raw scores of the candidates (None: a scorer of weight 0 that
        was not called, left out); ``picked``: the index picked."""
        for k, row in enumerate(scores):
            if row is None:
                continue
            mine = row[picked]
            clamped = 0.0 if mine <= 0.0 else (1.0 if mine > 1.0 else mine)
            self._score[k].observe(clamped * weights[k])
            top = getattr(row, "top", None)  # kept columns know their maximum
            (self._agreed if mine >= (max(row) if top is None else top) else self._disagreed)[k].inc()
