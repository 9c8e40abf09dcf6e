"""Plugin data scope: a filter or scorer reading (or writing) a per-request data key it did not
declare is counted in llm_d_epp_plugin_data_scope_violations_total with its labels."""

from __future__ import annotations

from collections.abc import Sequence

from epp import promlite
from epp.framework import CycleState, Endpoint, Filter, LLMRequest, NoParams, Scorer
from epp.framework.attributes import INFLIGHT_LOAD_KEY, PREFIX_CACHE_MATCH_INFO_KEY
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.scheduling.data_scope import DATA_SCOPE_VIOLATIONS
from epp.scheduling.profile import SchedulerProfile, WeightedScorer
from tests.unit.factories import endpoints, request


class _Snooper(Scorer):
    """Declares the in-flight load, reads the prefix-match data too."""

    type_name = "test-snooper-scorer"
    consumes = frozenset({INFLIGHT_LOAD_KEY})

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        cycle.get(INFLIGHT_LOAD_KEY)  # declared
        cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)  # not declared
        cycle["private/state"] = 1  # a plugin's own key is not confined
        return [0.5] * len(endpoints)


class _Writer(Filter):
    type_name = "test-writer-filter"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        cycle[INFLIGHT_LOAD_KEY] = {}  # produces nothing
        return endpoints


def _count(*labels: str) -> float:
    return DATA_SCOPE_VIOLATIONS.labels(*labels).value


def _profile() -> SchedulerProfile:
    picker = MaxScorePicker("picker", MaxScorePicker.Params())
    return SchedulerProfile(
        "default",
        filters=[_Writer("w", NoParams())],
        scorers=[WeightedScorer(_Snooper("s", NoParams()))],
        picker=picker,
    )


def test_undeclared_read_and_write_count_one_violation_each_with_labels() -> None:
    read = ("Scorer", "test-snooper-scorer", "s", "read")
    write = ("Filter", "test-writer-filter", "w", "write")
    before_read, before_write = _count(*read), _count(*write)
    cycle = CycleState()
    _profile().run(cycle, request(), endpoints(2))
    assert _count(*read) - before_read == 1
    assert _count(*write) - before_write == 1
    assert _count("Scorer", "test-snooper-scorer", "s", "write") == 0
    assert cycle.scope is None  # outside a plugin nothing is checked
    cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
    assert _count(*read) - before_read == 1
    page = promlite.exposition().decode()
    assert (
        'llm_d_epp_plugin_data_scope_violations_total{access="read",extension_point="Scorer",'
        'plugin_name="s",plugin_type="test-snooper-scorer"}' in page
    )


def test_declared_access_counts_nothing() -> None:
    class _Reader(Scorer):
        type_name = "test-reader-scorer"
        consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

        def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
            cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
            return [0.0] * len(endpoints)

    profile = SchedulerProfile(
        "p",
        scorers=[WeightedScorer(_Reader("r", NoParams()))],
        picker=MaxScorePicker("m", MaxScorePicker.Params()),
    )
    profile.run(CycleState(), request(), endpoints(2))
    assert _count("Scorer", "test-reader-scorer", "r", "read") == 0
