"""weighted-random-picker: A-Res sampling proportional to score, random fallback, distinct picks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.framework import (
    ConfigError,
    CycleState,
    ScoredEndpoint,
)
from epp.framework.params import decode_params
from epp.framework.registry import lookup
from epp.plugins.pickers._common import rng
from epp.plugins.pickers.weighted_random import WeightedRandomPicker
from tests.unit.factories import endpoints, request


def scored(scores: Sequence[float]) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(e, s) for e, s in zip(endpoints(len(scores)), scores, strict=True)]


def picker(raw: dict[str, Any] | None = None) -> WeightedRandomPicker:
    return WeightedRandomPicker("w", decode_params(WeightedRandomPicker.Params, raw, "plugins[0].parameters"))


def pick_names(p: WeightedRandomPicker, candidates: list[ScoredEndpoint]) -> list[str]:
    return [e.metadata.name for e in p.pick(CycleState(), request(), candidates).target_endpoints]


def frequencies(p: WeightedRandomPicker, candidates: list[ScoredEndpoint], draws: int) -> Counter[str]:
    return Counter(pick_names(p, candidates)[0] for _ in range(draws))


def test_registered() -> None:
    assert lookup("weighted-random-picker") is WeightedRandomPicker


def test_pick_probability_is_proportional_to_score() -> None:
    rng.seed(1234)
    counts = frequencies(picker(), scored([3.0, 1.0]), 4000)
    # expected 0.75; one standard deviation is sqrt(0.75*0.25/4000) ~ 0.0068, allow ~4.4 sigma
    assert abs(counts["e0"] / 4000 - 0.75) < 0.03


def test_uniform_scaling_does_not_change_the_distribution() -> None:
    rng.seed(99)
    counts = frequencies(picker(), scored([0.3, 0.1]), 4000)
    assert abs(counts["e0"] / 4000 - 0.75) < 0.03
    rng.seed(7)
    counts = frequencies(picker(), scored([1.0, 2.0, 1.0]), 4000)  # 25 % / 50 % / 25 %
    assert abs(counts["e1"] / 4000 - 0.5) < 0.035
    assert abs(counts["e0"] / 4000 - 0.25) < 0.03


def test_zero_and_negative_scores_are_never_picked_while_a_positive_exists() -> None:
    rng.seed(5)
    counts = frequencies(picker(), scored([0.0, 0.01, -1.0]), 500)
    assert counts == Counter({"e1": 500})


def test_all_non_positive_falls_back_to_uniform_random() -> None:
    rng.seed(11)
    counts = frequencies(picker(), scored([0.0, 0.0, -2.0]), 3000)
    for name in ("e0", "e1", "e2"):
        assert abs(counts[name] / 3000 - 1 / 3) < 0.04
    rng.seed(12)
    assert sorted(pick_names(picker({"maxNumOfEndpoints": 5}), scored([0.0, 0.0, 0.0]))) == ["e0", "e1", "e2"]


def test_tiny_positive_scores_still_beat_zero_scores() -> None:
    rng.seed(21)
    for tiny in (1e-3, 1e-38, 5e-324):
        counts = frequencies(picker(), scored([0.0, tiny, 0.0]), 300)
        assert counts == Counter({"e1": 300})


def test_zero_uniform_draw_is_replaced_by_a_tiny_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng, "random", lambda: 0.0)
    # keys: 1e-10 ** (1/1) = 1e-10 < 1e-10 ** (1/2) = 1e-5, so the higher score wins;
    # with U left at 0 both keys would be 0 and the first candidate would win
    assert pick_names(picker(), scored([1.0, 2.0])) == ["e1"]


def test_top_k_by_key_largest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    draws: Iterator[float] = iter([0.5, 0.9, 0.1, 0.7])
    monkeypatch.setattr(rng, "random", lambda: next(draws))
    # equal scores of 1: key = U, so the order is by U descending: e1 (0.9), e3 (0.7), e0 (0.5)
    assert pick_names(picker({"maxNumOfEndpoints": 3}), scored([1.0, 1.0, 1.0, 1.0])) == ["e1", "e3", "e0"]


def test_key_is_u_to_the_one_over_score(monkeypatch: pytest.MonkeyPatch) -> None:
    draws: Iterator[float] = iter([0.25, 0.6])
    monkeypatch.setattr(rng, "random", lambda: next(draws))
    # keys: 0.25 ** (1/2) = 0.5 for e0, 0.6 ** (1/1) = 0.6 for e1 -> e1 first, then e0
    assert pick_names(picker({"maxNumOfEndpoints": 2}), scored([2.0, 1.0])) == ["e1", "e0"]


def test_k_larger_than_positive_scores_fills_with_zero_score_endpoints() -> None:
    rng.seed(3)
    names = pick_names(picker({"maxNumOfEndpoints": 3}), scored([0.0, 1.0, 0.0, 2.0]))
    assert len(names) == 3
    assert set(names[:2]) == {"e1", "e3"}
    assert names[2] in {"e0", "e2"}


def test_max_num_of_endpoints_defaults_and_bounds() -> None:
    rng.seed(4)
    assert len(pick_names(picker(), scored([1.0, 1.0, 1.0]))) == 1
    assert len(pick_names(picker({"maxNumOfEndpoints": 0}), scored([1.0, 1.0, 1.0]))) == 1
    assert len(pick_names(picker({"maxNumOfEndpoints": -2}), scored([1.0, 1.0, 1.0]))) == 1
    assert len(pick_names(picker({"maxNumOfEndpoints": 10}), scored([1.0, 1.0, 1.0]))) == 3
    assert pick_names(picker(), []) == []
    with pytest.raises(ConfigError) as e:
        picker({"maxNumOfEndpoints": "two"})
    assert e.value.field == "plugins[0].parameters.maxNumOfEndpoints"


@settings(max_examples=200, deadline=None)
@given(
    scores=st.lists(
        st.one_of(st.just(0.0), st.floats(min_value=-1.0, max_value=10.0, allow_nan=False)),
        min_size=1,
        max_size=12,
    ),
    k=st.integers(min_value=-1, max_value=15),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_property_picks_are_distinct_candidates(scores: list[float], k: int, seed: int) -> None:
    rng.seed(seed)
    candidates = scored(scores)
    result = picker({"maxNumOfEndpoints": k}).pick(CycleState(), request(), candidates).target_endpoints
    ids = [id(e) for e in result]
    assert len(ids) == len(set(ids))  # distinct
    assert set(ids) <= {id(s.endpoint) for s in candidates}  # drawn from the candidates
    assert len(result) == min(max(k, 1), len(candidates))
    positive = {id(s.endpoint) for s in candidates if s.score > 0}
    # positive-score endpoints always come before any non-positive one
    if positive:
        head = ids[: min(len(positive), len(ids))]
        assert set(head) <= positive
