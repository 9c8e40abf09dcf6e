"""Flow-control policy plugins: ordering keys, fairness picks, usage-limit ceilings, parameters.

The bands and flows are small fakes with the semantics of ``epp.framework.flow``'s views: a flow
dispatches its smallest ``(sort_key, seq)``; a band lists its non-empty flows in the order they
became non-empty.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from epp.framework import (
    FairnessPolicy,
    FlowKey,
    FlowView,
    OrderingPolicy,
    QueueItem,
    ResponseInfo,
    SchedulingResult,
    UsageLimitPolicy,
)
from epp.framework.errors import ConfigError
from epp.plugins.flow_control.edf import EdfOrderingPolicy
from epp.plugins.flow_control.fcfs import FcfsOrderingPolicy
from epp.plugins.flow_control.global_strict import GlobalStrictFairnessPolicy
from epp.plugins.flow_control.priority_holdback import PriorityHoldbackParams, PriorityHoldbackPolicy
from epp.plugins.flow_control.program_aware import (
    ATTAINED_SERVICE_TOKENS,
    AVG_WAIT_TIME_MS,
    JAINS_FAIRNESS_INDEX,
    LOST_AFTER_SECONDS,
    ProgramAwareFairness,
    ProgramAwareFairnessParams,
)
from epp.plugins.flow_control.round_robin import RoundRobinFairnessPolicy
from epp.plugins.flow_control.slo_deadline import MAX_SLO_MS, SloDeadlineOrderingPolicy
from epp.plugins.flow_control.soft_reflective_ceiling import SoftReflectiveCeilingPolicy
from epp.plugins.flow_control.static_usage_limit import StaticUsageLimitParams, StaticUsageLimitPolicy
from tests.unit.factories import completions
from tests.unit.factories import config as load
from tests.unit.factories import config_error as load_error

# --- fakes ------------------------------------------------------------------------------------


@dataclass
class FakeFlow:
    key: FlowKey
    items: list[QueueItem] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def byte_size(self) -> int:
        return sum(i.byte_size for i in self.items)

    def peek(self) -> QueueItem:
        return min(self.items, key=lambda i: (i.sort_key, i.seq))

    def pop(self) -> QueueItem:
        head = self.peek()
        self.items.remove(head)
        return head


class FakeBand:
    """One band: queues items under its ordering policy, dispatches under its fairness policy."""

    def __init__(
        self, fairness: FairnessPolicy, ordering: OrderingPolicy | None = None, priority: int = 0
    ) -> None:
        self.fairness = fairness
        self.ordering = ordering or FcfsOrderingPolicy("fcfs", None)
        self._priority = priority
        self._state = fairness.new_state()
        self._flows: dict[str, FakeFlow] = {}  # non-empty flows, in the order they became non-empty
        self._seq = 0

    @property
    def priority(self) -> int:
        return self._priority

    @property
    def policy_state(self) -> Any:
        return self._state

    def flows(self) -> Iterator[FlowView]:
        yield from list(self._flows.values())

    def flow(self, flow_id: str) -> FlowView | None:
        return self._flows.get(flow_id)

    def add(
        self, flow_id: str, *, at: float | None = None, ttl: float = 0.0, slo_ms: float = 0.0
    ) -> QueueItem:
        self._seq += 1
        when = float(self._seq) if at is None else at
        item = make_item(flow_id, self._seq, when, ttl=ttl, slo_ms=slo_ms, priority=self._priority)
        item.sort_key = self.ordering.sort_key(item)
        flow = self._flows.get(flow_id)
        if flow is None:
            flow = self._flows[flow_id] = FakeFlow(item.key)
        flow.items.append(item)
        return item

    def dispatch(self) -> QueueItem | None:
        """One dispatch: the fairness policy picks a flow, its head leaves the band."""
        if not self._flows:
            return None
        picked = self.fairness.pick(self)
        if picked is None:
            return None
        flow = self._flows[picked.key.id]
        item = flow.pop()
        if not flow.items:
            del self._flows[picked.key.id]
        self.fairness.dispatched(self, item)
        return item

    def drain(self, n: int | None = None) -> list[QueueItem]:
        out: list[QueueItem] = []
        while n is None or len(out) < n:
            item = self.dispatch()
            if item is None:
                break
            out.append(item)
        return out


def make_item(
    flow_id: str,
    seq: int,
    enqueued_at: float,
    *,
    received_at: float | None = None,
    ttl: float = 0.0,
    slo_ms: float = 0.0,
    priority: int = 0,
) -> QueueItem:
    request = completions(request_id=f"{flow_id}-{seq}")
    request.fairness_id = flow_id
    request.slo_ttft_ms = slo_ms
    return QueueItem(
        request=request,
        key=FlowKey(flow_id, priority),
        byte_size=10,
        seq=seq,
        enqueued_at=enqueued_at,
        received_at=enqueued_at if received_at is None else received_at,
        ttl=ttl,
    )


def ids(items: list[QueueItem]) -> list[str]:
    return [i.key.id for i in items]


def dispatch_order(policy: OrderingPolicy, items: list[QueueItem]) -> list[int]:
    """The seqs of ``items`` in the order a flow under ``policy`` dispatches them."""
    for item in items:
        item.sort_key = policy.sort_key(item)
    return [i.seq for i in sorted(items, key=lambda i: (i.sort_key, i.seq))]


def series(gauge: Any) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels.values()): s.value for fam in gauge.families() for s in fam.samples}


# --- ordering ---------------------------------------------------------------------------------


def test_fcfs_orders_by_queue_entry_whatever_the_seq() -> None:
    rng = random.Random(1)
    times = [rng.uniform(0, 100) for _ in range(20)]
    items = [make_item("f", seq, t) for seq, t in enumerate(times)]
    order = dispatch_order(FcfsOrderingPolicy("fcfs", None), items)
    assert [times[s] for s in order] == sorted(times)


def test_fcfs_equal_times_keep_arrival_order() -> None:
    items = [make_item("f", seq, 5.0) for seq in (3, 1, 2)]
    assert dispatch_order(FcfsOrderingPolicy("fcfs", None), items) == [1, 2, 3]


def test_edf_earliest_deadline_first_then_items_without_ttl_in_fcfs_order() -> None:
    items = [
        make_item("f", 1, 0.0, ttl=30.0),  # deadline 30
        make_item("f", 2, 1.0),  # no TTL
        make_item("f", 3, 2.0, ttl=5.0),  # deadline 7
        make_item("f", 4, 3.0, ttl=60.0),  # deadline 63
        make_item("f", 5, 0.5),  # no TTL, entered before seq 2
        make_item("f", 6, 10.0, ttl=20.0),  # deadline 30 too, entered later than seq 1
    ]
    assert dispatch_order(EdfOrderingPolicy("edf", None), items) == [3, 1, 6, 4, 5, 2]


def test_edf_deadline_counts_from_queue_entry_not_arrival() -> None:
    early_arrival = make_item("f", 1, 10.0, received_at=0.0, ttl=5.0)  # deadline 15
    late_arrival = make_item("f", 2, 8.0, received_at=7.0, ttl=5.0)  # deadline 13
    assert dispatch_order(EdfOrderingPolicy("edf", None), [early_arrival, late_arrival]) == [2, 1]


def test_slo_deadline_orders_by_arrival_plus_ttft_slo() -> None:
    items = [
        make_item("f", 1, 5.0, received_at=0.0, slo_ms=2000),  # 2.0
        make_item("f", 2, 5.0, received_at=1.0, slo_ms=500),  # 1.5
        make_item("f", 3, 5.0, received_at=0.2),  # no SLO
        make_item("f", 4, 5.0, received_at=0.1),  # no SLO, arrived earlier
        make_item("f", 5, 5.0, received_at=1.9, slo_ms=100),  # 2.0, arrived after seq 1
    ]
    assert dispatch_order(SloDeadlineOrderingPolicy("slo", None), items) == [2, 1, 5, 4, 3]


@pytest.mark.parametrize("huge", [MAX_SLO_MS * 2, 1e300, math.nan])
def test_slo_deadline_out_of_range_values_count_as_no_slo(huge: float) -> None:
    items = [
        make_item("f", 1, 0.0, received_at=3.0),  # no SLO
        make_item("f", 2, 0.0, received_at=1.0, slo_ms=huge),
        make_item("f", 3, 0.0, received_at=2.0, slo_ms=MAX_SLO_MS),  # the largest usable SLO
    ]
    assert dispatch_order(SloDeadlineOrderingPolicy("slo", None), items) == [3, 2, 1]


def test_slo_deadline_ignores_queue_entry_and_ttl() -> None:
    a = make_item("f", 1, 100.0, received_at=0.0, ttl=1.0, slo_ms=1000)  # deadline 1.0
    b = make_item("f", 2, 0.0, received_at=0.5, ttl=100.0, slo_ms=1000)  # deadline 1.5
    assert dispatch_order(SloDeadlineOrderingPolicy("slo", None), [b, a]) == [1, 2]


# --- global-strict ----------------------------------------------------------------------------


@pytest.mark.parametrize("ordering", [FcfsOrderingPolicy, EdfOrderingPolicy, SloDeadlineOrderingPolicy])
def test_global_strict_dispatches_the_band_in_its_ordering(ordering: type[OrderingPolicy]) -> None:
    rng = random.Random(7)
    band = FakeBand(GlobalStrictFairnessPolicy("gs", None), ordering("o", None))
    added = []
    for _ in range(60):
        item = band.add(
            rng.choice("abcd"),
            at=rng.uniform(0, 50),
            ttl=rng.choice([0.0, rng.uniform(1, 30)]),
            slo_ms=rng.choice([0.0, rng.uniform(1, 30_000)]),
        )
        added.append(item)
    got = [i.seq for i in band.drain()]
    assert got == [i.seq for i in sorted(added, key=lambda i: (i.sort_key, i.seq))]


def test_global_strict_breaks_equal_keys_by_seq_across_flows() -> None:
    band = FakeBand(GlobalStrictFairnessPolicy("gs", None))
    for flow_id in ("b", "a", "c", "a", "b"):
        band.add(flow_id, at=1.0)  # equal sort keys
    assert [i.seq for i in band.drain()] == [1, 2, 3, 4, 5]


def test_global_strict_lets_one_flow_take_every_turn() -> None:
    band = FakeBand(GlobalStrictFairnessPolicy("gs", None))
    for _ in range(5):
        band.add("heavy")
    band.add("light")
    assert ids(band.drain()) == ["heavy"] * 5 + ["light"]


# --- round-robin ------------------------------------------------------------------------------


def test_round_robin_cycles_flows_in_id_order() -> None:
    band = FakeBand(RoundRobinFairnessPolicy("rr", None))
    for flow_id in ("c", "a", "b"):  # insertion order differs from id order
        for _ in range(3):
            band.add(flow_id)
    assert ids(band.drain()) == ["a", "b", "c"] * 3


def test_round_robin_skips_emptied_flows_and_admits_new_ones_in_turn() -> None:
    band = FakeBand(RoundRobinFairnessPolicy("rr", None))
    band.add("a")
    band.add("a")
    band.add("b")
    band.add("c")
    band.add("c")
    assert ids(band.drain(3)) == ["a", "b", "c"]  # b is empty now
    band.add("ab")  # sorts between a and b
    assert ids(band.drain(3)) == ["a", "ab", "c"]
    assert band.drain() == []


def test_round_robin_continues_after_a_vanished_flow() -> None:
    band = FakeBand(RoundRobinFairnessPolicy("rr", None))
    for flow_id in ("a", "b", "c", "d"):
        band.add(flow_id)
    band.add("a")
    band.add("d")
    assert ids(band.drain(2)) == ["a", "b"]  # b is gone, last pick was b
    assert ids(band.drain(1)) == ["c"]  # the successor of b, not a restart at a
    band.add("b")  # b comes back before the cursor
    assert ids(band.drain()) == ["d", "a", "b", "d"]


def test_round_robin_keeps_a_cursor_per_band() -> None:
    policy = RoundRobinFairnessPolicy("rr", None)
    one, two = FakeBand(policy, priority=1), FakeBand(policy, priority=2)
    for band in (one, two):
        for flow_id in ("x", "y", "z"):
            band.add(flow_id)
            band.add(flow_id)
    assert ids(one.drain(2)) == ["x", "y"]
    assert ids(two.drain(1)) == ["x"]  # unaffected by band one's turns
    assert ids(one.drain(1)) == ["z"]
    assert ids(two.drain(2)) == ["y", "z"]


def test_round_robin_gives_every_flow_an_equal_share_under_churn() -> None:
    rng = random.Random(3)
    band = FakeBand(RoundRobinFairnessPolicy("rr", None))
    served: dict[str, int] = {}
    for _ in range(400):
        for flow_id in ("a", "b", "c"):
            if rng.random() < 0.9:  # every flow stays backlogged most of the time
                band.add(flow_id)
        for item in band.drain(2):
            served[item.key.id] = served.get(item.key.id, 0) + 1
    assert max(served.values()) - min(served.values()) <= 0.1 * max(served.values())


# --- program-aware (LAS) ----------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def las(clock: Clock, **params: Any) -> ProgramAwareFairness:
    policy = ProgramAwareFairness("las", ProgramAwareFairnessParams(**params))
    policy.clock = clock
    return policy


def complete(policy: ProgramAwareFairness, program: str, prompt: int, completion: int) -> None:
    request = completions()
    request.fairness_id = program
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    policy.response_body(request, ResponseInfo(end_of_stream=True, usage=usage), None, b"")


def test_las_service_weights_output_tokens_twice() -> None:
    clock = Clock()
    policy = las(clock)
    complete(policy, "p", 10, 5)
    assert policy.attained_service("p") == pytest.approx(20.0)
    complete(policy, "p", 0, 7)
    assert policy.attained_service("p") == pytest.approx(34.0)
    assert series(ATTAINED_SERVICE_TOKENS)[("p",)] == pytest.approx(34.0)


def test_las_counts_only_the_end_of_stream_once() -> None:
    policy = las(Clock())
    request = completions()
    request.fairness_id = "p"
    usage = {"prompt_tokens": 100, "completion_tokens": 100}
    policy.response_body(request, ResponseInfo(end_of_stream=False, usage=usage), None, b"x")
    assert policy.attained_service("p") == 0.0
    policy.response_body(request, ResponseInfo(end_of_stream=True, usage=usage), None, b"")
    policy.response_body(request, ResponseInfo(end_of_stream=True, usage=usage), None, b"")
    assert policy.attained_service("p") == pytest.approx(300.0)


def test_las_prefers_the_program_with_less_attained_service() -> None:
    clock = Clock()
    policy = las(clock)
    complete(policy, "heavy", 1000, 1000)
    complete(policy, "light", 10, 10)
    band = FakeBand(policy)
    band.add("heavy", at=clock.now - 5)  # older head: only the wait term favours it
    band.add("light", at=clock.now)
    assert ids(band.drain(1)) == ["light"]


def test_las_without_service_picks_the_oldest_head() -> None:
    clock = Clock()
    band = FakeBand(las(clock))
    band.add("a", at=clock.now - 1)
    band.add("b", at=clock.now - 3)
    band.add("c", at=clock.now - 2)
    assert ids(band.drain(1)) == ["b"]


def test_las_service_decays_with_the_half_life() -> None:
    clock = Clock()
    policy = las(clock, las_half_life_seconds=60)
    complete(policy, "p", 800, 0)
    clock.now += 60
    assert policy.attained_service("p") == pytest.approx(400.0)
    clock.now += 120
    assert policy.attained_service("p") == pytest.approx(100.0)
    complete(policy, "p", 50, 0)  # decay is folded in before new service is added
    assert policy.attained_service("p") == pytest.approx(150.0)


def test_las_half_life_zero_keeps_service_forever() -> None:
    clock = Clock()
    policy = las(clock, las_half_life_seconds=0)
    complete(policy, "p", 800, 0)
    clock.now += 1e6
    assert policy.attained_service("p") == 800.0


@pytest.mark.parametrize(("idle", "expected"), [(10.0, "recent"), (290.0, "old")])
def test_las_an_idle_heavy_program_regains_priority_as_its_service_decays(idle: float, expected: str) -> None:
    clock = Clock()
    policy = las(clock, las_half_life_seconds=60, las_weight_head_wait=0.0, las_weight_service=1.0)
    complete(policy, "old", 1000, 0)
    clock.now += idle  # never visited by a pick meanwhile
    complete(policy, "recent", 100, 0)
    band = FakeBand(policy)
    band.add("old", at=clock.now)
    band.add("recent", at=clock.now)
    assert ids(band.drain(1)) == [expected]


def test_las_shares_dispatches_by_attained_service_over_time() -> None:
    """Two backlogged programs, one sending 10x larger responses: the small one gets more turns."""
    clock = Clock()
    policy = las(clock)
    band = FakeBand(policy)
    cost = {"big": 1000, "small": 100}
    served = {"big": 0, "small": 0}
    for _ in range(300):
        for program in cost:
            if len(band.flow(program) or ()) < 3:
                band.add(program, at=clock.now)
        item = band.dispatch()
        assert item is not None
        served[item.key.id] += 1
        clock.now += 0.1
        complete(policy, item.key.id, 0, cost[item.key.id])
    assert served["small"] > 3 * served["big"]


def test_las_tracks_in_flight_and_waits_through_dispatch_and_completion() -> None:
    clock = Clock()
    policy = las(clock)
    band = FakeBand(policy)
    band.add("a", at=clock.now - 0.1)
    band.add("b", at=clock.now - 0.3)
    items = band.drain()
    progs = policy.programs()
    assert progs["a"]["in_flight"] == 1 and progs["b"]["in_flight"] == 1
    assert progs["a"]["avg_wait_ms"] == pytest.approx(100.0)
    assert progs["b"]["avg_wait_ms"] == pytest.approx(300.0)
    assert series(AVG_WAIT_TIME_MS)[("b",)] == pytest.approx(300.0)
    # Jain's index over the mean waits: (100 + 300)^2 / (2 * (100^2 + 300^2)) = 0.8
    assert policy.fairness_index() == pytest.approx(0.8)
    assert series(JAINS_FAIRNESS_INDEX)[()] == pytest.approx(0.8)
    for item in items:
        policy.request_done(item.request, SchedulingResult({}, ""))
        policy.request_done(item.request, SchedulingResult({}, ""))  # a second call changes nothing
    assert policy.programs()["a"]["in_flight"] == 0 and policy.programs()["b"]["in_flight"] == 0


def test_las_jains_index_is_one_for_a_single_program() -> None:
    clock = Clock()
    policy = las(clock)
    band = FakeBand(policy)
    band.add("only", at=clock.now - 2)
    band.drain()
    assert policy.fairness_index() == 1.0


def test_las_request_done_ignores_requests_it_did_not_dispatch() -> None:
    clock = Clock()
    policy = las(clock)
    band = FakeBand(policy)
    band.add("a", at=clock.now)
    band.drain()
    stranger = completions()
    stranger.fairness_id = "a"
    policy.request_done(stranger, SchedulingResult({}, ""))
    assert policy.programs()["a"]["in_flight"] == 1


def test_las_evicts_idle_programs_but_not_busy_ones() -> None:
    clock = Clock()
    policy = las(clock, eviction_ttl_seconds=10, eviction_sweep_seconds=5)
    band = FakeBand(policy)
    complete(policy, "idle", 10, 10)
    band.add("busy", at=clock.now)
    band.drain()  # busy now has a request in flight
    assert set(policy.programs()) == {"idle", "busy"}
    clock.now += 11
    band.add("fresh", at=clock.now)
    band.drain()  # a pick after the sweep interval runs the sweep
    assert set(policy.programs()) == {"busy", "fresh"}
    assert ("idle",) not in series(ATTAINED_SERVICE_TOKENS)
    assert policy.attained_service("idle") == 0.0


def test_las_a_request_whose_end_never_comes_stops_protecting_its_program() -> None:
    clock = Clock()
    policy = las(clock, eviction_ttl_seconds=10, eviction_sweep_seconds=5)
    band = FakeBand(policy)
    band.add("lost", at=clock.now)
    band.drain()  # dispatched, then failed before routing: no request_done
    clock.now += 100
    band.add("other", at=clock.now)
    band.drain()
    assert "lost" in policy.programs()  # in flight: kept although idle for longer than the TTL
    clock.now += LOST_AFTER_SECONDS
    band.add("other", at=clock.now)
    band.drain()
    assert "lost" not in policy.programs()


def test_las_eviction_ttl_zero_keeps_every_program() -> None:
    clock = Clock()
    policy = las(clock, eviction_ttl_seconds=0, eviction_sweep_seconds=1)
    complete(policy, "p", 1, 1)
    band = FakeBand(policy)
    for _ in range(3):
        clock.now += 1e5
        band.add("q", at=clock.now)
        band.drain()
    assert set(policy.programs()) == {"p", "q"}


# --- usage limits -----------------------------------------------------------------------------


def ceilings_of(policy: UsageLimitPolicy, saturation: float, priorities: list[int]) -> list[float]:
    out = [1.0] * len(priorities)
    policy.compute_limit(saturation, priorities, out)
    return out


def test_static_usage_limit_writes_its_threshold_everywhere() -> None:
    assert ceilings_of(StaticUsageLimitPolicy("s", None), 0.5, [3, 2, 1]) == [1.0, 1.0, 1.0]
    policy = StaticUsageLimitPolicy("s", StaticUsageLimitParams(threshold=0.7))
    assert ceilings_of(policy, 0.99, [10, 0, -5]) == [0.7, 0.7, 0.7]
    assert ceilings_of(policy, 0.0, []) == []


def holdback(min_ceiling: float, max_ceiling: float = 1.0, domain: str = "rank") -> PriorityHoldbackPolicy:
    return PriorityHoldbackPolicy(
        "h", PriorityHoldbackParams(min_ceiling=min_ceiling, max_ceiling=max_ceiling, domain=domain)
    )


def test_holdback_rank_spaces_ceilings_evenly_by_rank() -> None:
    got = ceilings_of(holdback(0.4, 0.9), 0.5, [100, 99, 3, -7])
    assert got == pytest.approx([0.9, 0.9 - 0.5 / 3, 0.9 - 1.0 / 3, 0.4])


def test_holdback_value_spaces_ceilings_by_priority_value() -> None:
    got = ceilings_of(holdback(0.2, 1.0, "value"), 0.5, [100, 90, 50, 0])
    assert got == pytest.approx([1.0, 0.92, 0.6, 0.2])
    # Rank ignores the spacing: the same priorities get even steps.
    assert ceilings_of(holdback(0.2, 1.0), 0.5, [100, 90, 50, 0]) == pytest.approx(
        [1.0, 0.2 + 0.8 * 2 / 3, 0.2 + 0.8 / 3, 0.2]
    )


@pytest.mark.parametrize("domain", ["rank", "value"])
def test_holdback_single_band_gets_the_max_ceiling(domain: str) -> None:
    assert ceilings_of(holdback(0.1, 0.8, domain), 0.95, [5]) == [0.8]


def test_holdback_ceilings_do_not_depend_on_saturation() -> None:
    policy = holdback(0.3, 0.9, "value")
    assert ceilings_of(policy, 0.0, [4, 2, 0]) == ceilings_of(policy, 0.99, [4, 2, 0])


def _random_priorities(rng: random.Random) -> list[int]:
    return sorted(rng.sample(range(-50, 50), rng.randint(1, 8)), reverse=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: StaticUsageLimitPolicy("s", StaticUsageLimitParams(threshold=0.6)),
        lambda: holdback(0.0, 1.0),
        lambda: holdback(0.35, 0.8, "value"),
        lambda: SoftReflectiveCeilingPolicy("s", None),
    ],
    ids=["static", "holdback-rank", "holdback-value", "soft-reflective"],
)
def test_ceilings_never_increase_along_the_priorities(make: Any) -> None:
    policy = make()
    rng = random.Random(11)
    for _ in range(500):
        priorities = _random_priorities(rng)
        got = ceilings_of(policy, rng.choice([0.0, 0.5, 0.99, 1.0, 1.3, rng.random()]), priorities)
        assert all(0.0 <= c <= 1.0 for c in got), got
        assert all(a >= b for a, b in itertools.pairwise(got)), (priorities, got)


def test_soft_reflective_single_band_is_always_open() -> None:
    policy = SoftReflectiveCeilingPolicy("s", None)
    assert ceilings_of(policy, 0.9, [1]) == [1.0]


def test_soft_reflective_bands_below_their_reflective_ceiling_stay_open() -> None:
    policy = SoftReflectiveCeilingPolicy("s", None)
    # N = 5, saturation 0.3: the lowest band's ceiling is 1 - 0.3 = 0.7 > 0.3, all open, every call.
    for _ in range(10):
        assert ceilings_of(policy, 0.3, [4, 3, 2, 1, 0]) == [1.0] * 5


def test_soft_reflective_full_saturation_closes_every_lower_band() -> None:
    policy = SoftReflectiveCeilingPolicy("s", None)
    for _ in range(5):
        assert ceilings_of(policy, 1.0, [2, 1, 0]) == [1.0, 0.0, 0.0]


def _period(saturation: float) -> int:
    return max(1, math.floor(saturation / (1.0 - saturation) + 0.5))


@pytest.mark.parametrize("saturation", [0.5, 0.6, 0.75, 0.8, 0.9, 0.95])
def test_soft_reflective_gated_bands_open_one_call_in_period(saturation: float) -> None:
    policy = SoftReflectiveCeilingPolicy("s", None)
    priorities = [4, 3, 2, 1, 0]
    calls = 600
    opens = []
    for call in range(calls):
        got = ceilings_of(policy, saturation, priorities)
        for i in range(1, 5):
            if saturation < 1 - i * saturation / 4:
                assert got[i] == 1.0  # still under its reflective ceiling
        gated = [got[i] for i in range(1, 5) if saturation >= 1 - i * saturation / 4]
        assert gated and len(set(gated)) == 1  # all gated bands share one decision
        if gated[0] == 1.0:
            opens.append(call)
    period = _period(saturation)
    assert len(opens) == calls // period
    assert all(b - a == period for a, b in itertools.pairwise(opens))  # evenly spread


def test_soft_reflective_duty_cycle_falls_as_saturation_rises() -> None:
    rates = []
    for saturation in (0.55, 0.7, 0.8, 0.9, 0.97):
        policy = SoftReflectiveCeilingPolicy("s", None)
        opens = sum(ceilings_of(policy, saturation, [1, 0])[1] == 1.0 for _ in range(1000))
        rates.append(opens / 1000)
        assert rates[-1] == pytest.approx((1 - saturation) / saturation, abs=0.35)
    assert rates == sorted(rates, reverse=True)


def test_soft_reflective_counter_only_advances_in_the_alternating_regime() -> None:
    policy = SoftReflectiveCeilingPolicy("s", None)
    for _ in range(7):
        ceilings_of(policy, 0.2, [1, 0])  # not gated: no tick
    # saturation 0.75: period 3; the first gated call is tick 1, closed; tick 3 opens.
    assert [ceilings_of(policy, 0.75, [1, 0])[1] for _ in range(6)] == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


# --- parameters and configuration -------------------------------------------------------------

ALL_POLICIES = """
featureGates: [flowControl]
plugins:
- {type: queue-scorer}
- {type: max-score-picker}
- {type: single-profile-handler}
- {name: rr, type: round-robin-fairness-policy}
- {name: las, type: program-aware-fairness, parameters: {lasHalfLifeSeconds: 30}}
- {name: gs, type: global-strict-fairness-policy}
- {name: edf, type: edf-ordering-policy}
- {name: slo, type: slo-deadline-ordering-policy}
- {name: fifo, type: fcfs-ordering-policy}
- {name: hold, type: priority-holdback-policy, parameters: {minCeiling: 0.4, domain: value}}
- {name: soft, type: soft-reflective-ceiling-policy}
- {name: static, type: static-usage-limit-policy, parameters: {threshold: 0.9}}
flowControl:
  defaultPriorityBand: {fairnessPolicyRef: las, orderingPolicyRef: slo}
  defaultNegativePriorityBand: {fairnessPolicyRef: gs, orderingPolicyRef: fifo}
  priorityBands:
  - {priority: 10, fairnessPolicyRef: rr, orderingPolicyRef: edf}
  usageLimitPolicyPluginRef: hold
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""


def test_every_policy_type_loads_and_is_referenced_by_the_bands() -> None:
    cfg = load(ALL_POLICIES)
    fc = cfg.document.flow_control
    assert fc is not None and fc.default_priority_band is not None
    assert (fc.default_priority_band.fairness_policy_ref, fc.default_priority_band.ordering_policy_ref) == (
        "las",
        "slo",
    )
    assert fc.priority_bands[0].fairness_policy_ref == "rr"
    assert fc.usage_limit_policy_plugin_ref == "hold"
    assert isinstance(cfg.plugins["las"], ProgramAwareFairness)
    assert cfg.plugins["las"].params.las_half_life_seconds == 30.0
    assert isinstance(cfg.plugins["hold"], PriorityHoldbackPolicy)
    assert isinstance(cfg.plugins["soft"], SoftReflectiveCeilingPolicy)
    assert cfg.plugins["las"] in cfg.response_body  # learns usage from responses
    assert cfg.plugins["las"] in cfg.request_done


def test_policies_load_with_the_gate_off_and_the_section_is_ignored() -> None:
    cfg = load(ALL_POLICIES.replace("featureGates: [flowControl]\n", ""))
    assert "flowControl" not in cfg.feature_gates
    assert isinstance(cfg.plugins["rr"], RoundRobinFairnessPolicy)
    assert any("feature gate is disabled" in w for w in cfg.warnings)


def test_default_policies_are_created_for_flow_control() -> None:
    cfg = load("featureGates: [flowControl]\n")
    assert isinstance(cfg.plugins["global-strict-fairness-policy"], GlobalStrictFairnessPolicy)
    assert isinstance(cfg.plugins["fcfs-ordering-policy"], FcfsOrderingPolicy)
    assert isinstance(cfg.plugins["static-usage-limit-policy"], StaticUsageLimitPolicy)
    fc = cfg.document.flow_control
    assert fc is not None and fc.usage_limit_policy_plugin_ref == "static-usage-limit-policy"


@pytest.mark.parametrize("type_name", ["priority-holdback-policy", "soft-reflective-ceiling-policy"])
def test_alpha_usage_limits_need_experimental_plugins(type_name: str) -> None:
    params = ", parameters: {minCeiling: 0.5}" if type_name == "priority-holdback-policy" else ""
    err = load_error(f"plugins:\n- {{type: {type_name}{params}}}\n", allow_experimental=False)
    assert err.field == "plugins[0].type" and "--allow-experimental-plugins" in err.reason


@pytest.mark.parametrize(
    ("plugin", "key", "reason"),
    [
        (
            "{type: program-aware-fairness, parameters: {lasDecayFactor: 0.99}}",
            "lasDecayFactor",
            "unknown parameter",
        ),
        (
            "{type: program-aware-fairness, parameters: {strategy: wfq}}",
            "strategy",
            'only "las" is supported',
        ),
        (
            "{type: program-aware-fairness, parameters: {evictionTtlSeconds: -1}}",
            "evictionTtlSeconds",
            ">= 0",
        ),
        (
            "{type: program-aware-fairness, parameters: {evictionSweepSeconds: 0}}",
            "evictionSweepSeconds",
            "> 0",
        ),
        ("{type: program-aware-fairness, parameters: {lasWeightService: -0.1}}", "lasWeightService", ">= 0"),
        ("{type: program-aware-fairness, parameters: {lasWeightHeadWait: -1}}", "lasWeightHeadWait", ">= 0"),
        (
            "{type: program-aware-fairness, parameters: {lasHalfLifeSeconds: -1}}",
            "lasHalfLifeSeconds",
            ">= 0",
        ),
        (
            "{type: program-aware-fairness, parameters: {lasHalfLifeSeconds: .inf}}",
            "lasHalfLifeSeconds",
            "finite",
        ),
        ("{type: priority-holdback-policy}", "minCeiling", "minCeiling is required"),
        ("{type: priority-holdback-policy, parameters: {minCeiling: 1.0}}", "minCeiling", "[0.0, 1.0)"),
        ("{type: priority-holdback-policy, parameters: {minCeiling: -0.1}}", "minCeiling", "[0.0, 1.0)"),
        (
            "{type: priority-holdback-policy, parameters: {minCeiling: 0.5, maxCeiling: 0}}",
            "maxCeiling",
            "(0.0, 1.0]",
        ),
        (
            "{type: priority-holdback-policy, parameters: {minCeiling: 0.6, maxCeiling: 0.6}}",
            "minCeiling",
            "strictly less than maxCeiling",
        ),
        (
            "{type: priority-holdback-policy, parameters: {minCeiling: 0.5, shape: sigmoid}}",
            "shape",
            "unsupported shape",
        ),
        (
            "{type: priority-holdback-policy, parameters: {minCeiling: 0.5, domain: log}}",
            "domain",
            "unsupported domain",
        ),
        ("{type: static-usage-limit-policy, parameters: {threshold: 0}}", "threshold", "(0.0, 1.0]"),
        ("{type: static-usage-limit-policy, parameters: {threshold: 1.5}}", "threshold", "(0.0, 1.0]"),
        ("{type: soft-reflective-ceiling-policy, parameters: {period: 3}}", "period", "unknown parameter"),
        ("{type: round-robin-fairness-policy, parameters: {quantum: 3}}", "quantum", "unknown parameter"),
    ],
)
def test_parameter_errors_name_the_field(plugin: str, key: str, reason: str) -> None:
    err = load_error(f"plugins:\n- {plugin}\n")
    assert err.field == f"plugins[0].parameters.{key}"
    assert reason in err.reason


def test_params_built_directly_are_validated_too() -> None:
    with pytest.raises(ConfigError) as info:
        PriorityHoldbackPolicy("h", PriorityHoldbackParams())
    assert info.value.field == "minCeiling"
    with pytest.raises(ConfigError) as info:
        ProgramAwareFairness("p", ProgramAwareFairnessParams(las_weight_service=-1))
    assert info.value.field == "lasWeightService"
