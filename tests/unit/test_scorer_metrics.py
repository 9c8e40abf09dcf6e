"""Per-scorer decision metrics: each scorer's weighted score of the picked endpoint, and whether the
pick was that scorer's best."""

from __future__ import annotations

from collections.abc import Sequence

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.scheduling import SchedulerProfile, WeightedScorer
from epp.scheduling.scorer_metrics import PICKED_SCORE, PICKS
from tests.unit.factories import endpoint, known_metrics, request


class _Fixed(Scorer):
    type_name = "fixed-test"

    def __init__(self, name: str, scores: Sequence[float]) -> None:
        super().__init__(name, None)
        self.scores = scores

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        return self.scores


def test_each_scorer_records_its_share_of_the_pick_and_whether_it_agreed() -> None:
    eps = [endpoint(f"e{i}", f"10.0.0.{i}", metrics=known_metrics()) for i in range(3)]
    # e1 wins: 0.9*2 + 0.2 = 2.0 against e0's 0.1*2 + 1.0 = 1.2
    profile = SchedulerProfile(
        "metrics-test",
        scorers=[
            WeightedScorer(_Fixed("likes-e1", [0.1, 0.9, 0.3]), 2.0),
            WeightedScorer(_Fixed("likes-e0", [1.0, 0.2, 0.0]), 1.0),
        ],
        picker=MaxScorePicker("m", PickerParams()),
    )
    for _ in range(3):
        assert profile.run(CycleState(), request(), eps).target_endpoints == [eps[1]]
    agreed = PICKS.labels("metrics-test", "fixed-test", "likes-e1", "true").value
    disagreed = PICKS.labels("metrics-test", "fixed-test", "likes-e0", "false").value
    assert (agreed, disagreed) == (3, 3)
    assert PICKS.labels("metrics-test", "fixed-test", "likes-e0", "true").value == 0
    winner = PICKED_SCORE.labels("metrics-test", "fixed-test", "likes-e1")
    loser = PICKED_SCORE.labels("metrics-test", "fixed-test", "likes-e0")
    assert abs(winner.sum - 3 * 1.8) < 1e-9 and abs(loser.sum - 3 * 0.2) < 1e-9
