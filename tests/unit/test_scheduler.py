"""Scheduler core: profile runs (filters, clamped weighted scores, picker) and the handler loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.framework import (
    CycleState,
    Endpoint,
    Filter,
    LLMRequest,
    Profile,
    ProfileHandler,
    ProfileRunResult,
    SchedulingOutcome,
    SchedulingResult,
    Scorer,
)
from epp.plugins.pickers._common import PickerParams, rng
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.pickers.random_picker import RandomPicker
from epp.plugins.profile_handlers.single import SingleProfileHandler
from epp.plugins.scorers.kv_cache_utilization import KVCacheUtilizationScorer
from epp.plugins.scorers.queue import QueueScorer
from epp.scheduling import Scheduler, SchedulerProfile, WeightedScorer
from tests.unit.factories import endpoint, known_metrics, request


def make_endpoints(queues: Sequence[int], kv: Sequence[float] | None = None) -> list[Endpoint]:
    kv = kv or [0.0] * len(queues)
    return [
        endpoint(
            f"e{i}", f"10.0.0.{i}", metrics=known_metrics(waiting_queue_size=q, kv_cache_usage_percent=k)
        )
        for i, (q, k) in enumerate(zip(queues, kv, strict=True))
    ]


class _Fixed(Scorer):
    type_name = "fixed"

    def __init__(self, scores: Sequence[float]) -> None:
        super().__init__("fixed", None)
        self.scores = scores

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        return self.scores


class _KeepEven(Filter):
    type_name = "keep-even"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return [e for e in endpoints if int(e.metadata.name[1:]) % 2 == 0]


def test_queue_scorer_min_max_and_all_equal() -> None:
    eps = make_endpoints([0, 5, 10])
    assert QueueScorer("q", None).score(CycleState(), request(), eps) == [1.0, 0.5, 0.0]
    assert QueueScorer("q", None).score(CycleState(), request(), make_endpoints([3, 3])) == [1.0, 1.0]


def test_kv_scorer_is_free_fraction() -> None:
    eps = make_endpoints([0, 0], kv=[0.25, 1.0])
    assert KVCacheUtilizationScorer("kv", None).score(CycleState(), request(), eps) == [0.75, 0.0]


def test_weighted_sum_clamps_each_score_to_unit_interval() -> None:
    eps = make_endpoints([0, 0, 0])
    # e0: 5 clamps to 1 (x2) = 2; e1: -3 clamps to 0, plus 0.9 = 0.9; e2: 0.6*2 + 0.5 = 1.7
    profile = SchedulerProfile(
        "p",
        scorers=[WeightedScorer(_Fixed([5.0, -3.0, 0.6]), 2.0), WeightedScorer(_Fixed([0.0, 0.9, 0.5]), 1.0)],
        picker=MaxScorePicker("m", PickerParams()),
    )
    result = profile.run(CycleState(), request(), eps)
    assert result.target_endpoints == [eps[0]]


def test_filter_then_pick_only_survivors() -> None:
    eps = make_endpoints([9, 0, 9, 0])  # the odd ones have the best queue but are filtered out
    profile = SchedulerProfile(
        "p",
        filters=[_KeepEven("f", None)],
        scorers=[WeightedScorer(QueueScorer("q", None))],
        picker=MaxScorePicker("m", PickerParams()),
    )
    picked = profile.run(CycleState(), request(), eps).target_endpoints[0]
    assert picked in (eps[0], eps[2])


def test_max_score_picker_returns_k_best_in_order() -> None:
    eps = make_endpoints([0, 0, 0, 0])
    profile = SchedulerProfile(
        "p",
        scorers=[WeightedScorer(_Fixed([0.1, 0.9, 0.5, 0.7]))],
        picker=MaxScorePicker("m", PickerParams(max_num_of_endpoints=3)),
    )
    assert profile.run(CycleState(), request(), eps).target_endpoints == [eps[1], eps[3], eps[2]]


def test_max_score_ties_are_broken_at_random() -> None:
    rng.seed(7)
    eps = make_endpoints([1, 1, 1])
    profile = SchedulerProfile(
        "p", scorers=[WeightedScorer(QueueScorer("q", None))], picker=MaxScorePicker("m", PickerParams())
    )
    seen = {profile.run(CycleState(), request(), eps).target_endpoints[0].metadata.name for _ in range(60)}
    assert seen == {"e0", "e1", "e2"}


def test_single_handler_failed_profile_is_an_error_and_results_hold_none() -> None:
    eps = make_endpoints([0, 0])

    class _None(Filter):
        type_name = "none"

        def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
            return []

    profile = SchedulerProfile(
        "default", filters=[_None("n", None)], picker=MaxScorePicker("m", PickerParams())
    )
    handler = SingleProfileHandler("single-profile-handler", None)
    seen: dict[str, object] = {}
    original = handler.process_results

    def spy(cycle: CycleState, req: LLMRequest, results: Mapping[str, ProfileRunResult | None]):  # type: ignore[no-untyped-def]
        seen.update(results)
        return original(cycle, req, results)

    handler.process_results = spy  # type: ignore[method-assign]
    result, err = Scheduler(handler, {"default": profile}).schedule(CycleState(), request(), eps)
    assert result is None
    assert str(err) == "failed to run scheduler profile 'default'"
    assert "default" in seen and seen["default"] is None  # explicit None entry, not a missing key


class _TwoStage(ProfileHandler):
    """Runs 'decode' then 'prefill'; a failed prefill is tolerated (decode-only)."""

    type_name = "two-stage"

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        if "decode" not in results:
            return {"decode": profiles["decode"]}
        if "prefill" not in results and results["decode"] is not None:
            return {"prefill": profiles["prefill"]}
        return {}

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        if results.get("decode") is None:
            return SchedulingOutcome.fail(RuntimeError("failed to find available decode workers"))
        return SchedulingOutcome.serve(SchedulingResult({k: v for k, v in results.items()}, "decode"))


@settings(max_examples=60, deadline=None)
@given(
    queues=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    prefill_ok=st.booleans(),
    decode_ok=st.booleans(),
)
def test_property_picked_endpoint_passed_filters_and_failed_profiles_are_none(
    queues: list[int], prefill_ok: bool, decode_ok: bool
) -> None:
    eps = make_endpoints(queues)

    class _Gate(Filter):
        type_name = "gate"

        def __init__(self, ok: bool) -> None:
            super().__init__("gate", None)
            self.ok = ok

        def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
            return [e for e in endpoints if e.metrics.waiting_queue_size % 2 == 0] if self.ok else []

    def profile(name: str, ok: bool) -> SchedulerProfile:
        return SchedulerProfile(
            name,
            filters=[_Gate(ok)],
            scorers=[WeightedScorer(QueueScorer("q", None))],
            picker=RandomPicker("r", PickerParams()),
        )

    scheduler = Scheduler(
        _TwoStage("two-stage", None),
        {"decode": profile("decode", decode_ok), "prefill": profile("prefill", prefill_ok)},
    )
    result, err = scheduler.schedule(CycleState(), request(), eps)
    any_even = any(q % 2 == 0 for q in queues)
    if not (decode_ok and any_even):
        assert result is None and err is not None  # a failed decode fails the request
        return
    assert err is None and result is not None
    decode = result.profile_results["decode"]
    assert decode is not None
    picked = decode.target_endpoints[0]
    assert picked in eps and picked.metrics.waiting_queue_size % 2 == 0  # passed the profile's filters
    assert "prefill" in result.profile_results  # ran: present even when it failed
    if not prefill_ok:
        assert result.profile_results["prefill"] is None  # decode-only
