"""The flow controller: dispatch order, gating, capacity, TTLs, cancellation, shutdown, stages."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from epp.flowcontrol import BandSettings, FlowController, FlowControlSettings
from epp.flowcontrol import metrics as fcm
from epp.framework import (
    BandView,
    Endpoint,
    FairnessPolicy,
    FlowView,
    InferenceError,
    LLMRequest,
    OrderingPolicy,
    QueueItem,
    SaturationDetector,
    UsageLimitPolicy,
)
from epp.framework.wire import REQUEST_DROPPED_REASON_HEADER
from tests.unit import factories
from tests.unit.factories import endpoint


class Fifo(OrderingPolicy):
    type_name = "test-fifo"

    def sort_key(self, item: QueueItem) -> tuple[float, ...]:
        return (item.seq,)


class Strict(FairnessPolicy):
    """The flow whose head arrived first."""

    type_name = "test-strict"

    def pick(self, band: BandView) -> FlowView | None:
        return min(band.flows(), key=lambda f: (f.peek().sort_key, f.peek().seq), default=None)


class Broken(FairnessPolicy):
    type_name = "test-broken"

    def pick(self, band: BandView) -> FlowView | None:
        raise RuntimeError("boom")


class Detector(SaturationDetector):
    """Saturation set by the test, plus ``per_pending`` for each pending request."""

    type_name = "test-detector"

    def __init__(self, value: float = 0.0, per_pending: float = 0.0) -> None:
        super().__init__("d", None)
        self.value = value
        self.per_pending = per_pending
        self.calls: list[tuple[int, int]] = []  # (endpoints, pending)
        self.fail = False

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        return self.value

    def dispatch_saturation(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        self.calls.append((len(endpoints), pending))
        if self.fail:
            raise RuntimeError("detector down")
        return self.value + pending * self.per_pending


class Ceilings(UsageLimitPolicy):
    type_name = "test-ceilings"

    def __init__(self, by_priority: dict[int, float]) -> None:
        super().__init__("c", None)
        self.by_priority = by_priority
        self.seen: list[list[int]] = []

    def compute_limit(self, saturation: float, priorities: Sequence[int], ceilings: list[float]) -> None:
        self.seen.append(list(priorities))
        for i, p in enumerate(priorities):
            if p in self.by_priority:
                ceilings[i] = self.by_priority[p]


FIFO, STRICT = Fifo("fifo", None), Strict("strict", None)


def band(max_requests: int = 0, max_bytes: int = 0, fairness: FairnessPolicy = STRICT) -> BandSettings:
    return BandSettings(max_requests=max_requests, max_bytes=max_bytes, fairness=fairness, ordering=FIFO)


def request(rid: str, priority: int = 0, flow: str = "default-flow", size: int = 10) -> LLMRequest:
    r = factories.request(request_id=rid, size=size)
    r.priority = priority
    r.fairness_id = flow
    return r


class Rig:
    def __init__(self, settings: FlowControlSettings | None = None, detector: Detector | None = None) -> None:
        self.pool: list[Endpoint] = [endpoint("a", "10.0.0.1"), endpoint("b", "10.0.0.2")]
        self.detector = detector or Detector()
        self.fc = FlowController(
            settings or FlowControlSettings(default_band=band()),
            self.detector,
            lambda: self.pool,
            pool_name="pool",
            tick=0.002,
        )
        self.order: list[str] = []
        self.errors: dict[str, InferenceError] = {}

    def start(self, req: LLMRequest) -> asyncio.Task[Any]:
        async def go() -> None:
            try:
                permit = await self.fc.admit(req, 0.0)
            except InferenceError as e:
                self.errors[req.request_id] = e
                return
            self.order.append(req.request_id)
            permit.release()

        return asyncio.ensure_future(go())


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def reason(err: InferenceError) -> str:
    return err.headers.get(REQUEST_DROPPED_REASON_HEADER, "")


async def test_unsaturated_requests_dispatch_at_once_and_count_as_pending_until_routed() -> None:
    rig = Rig()
    permit = await rig.fc.admit(request("r1"), 0.0)
    assert rig.fc.queued == 0 and rig.fc.pending == 1
    permit.release()
    permit.release()  # idempotent
    assert rig.fc.pending == 0


async def test_saturated_requests_wait_and_go_by_priority_then_arrival() -> None:
    rig = Rig(detector=Detector(value=1.0))
    tasks = [
        rig.start(request("low-1", priority=-1)),
        rig.start(request("mid-1", priority=0)),
        rig.start(request("high-1", priority=5)),
        rig.start(request("mid-2", priority=0)),
        rig.start(request("high-2", priority=5)),
    ]
    await settle()
    assert rig.order == [] and rig.fc.queued == 5
    rig.detector.value = 0.0
    rig.fc.kick()
    await asyncio.gather(*tasks)
    assert rig.order == ["high-1", "high-2", "mid-1", "mid-2", "low-1"]


async def test_pending_requests_feed_the_gate_so_one_opening_does_not_release_the_whole_queue() -> None:
    rig = Rig(detector=Detector(value=1.0, per_pending=0.25))
    tasks = [rig.start(request(f"r{i}")) for i in range(6)]
    await settle()
    rig.detector.value = 0.5  # room for two: 0.5 + 2 x 0.25 reaches 1.0
    permits = []

    async def hold(req: LLMRequest) -> None:
        permits.append(await rig.fc.admit(req, 0.0))

    holders = [asyncio.ensure_future(hold(request(f"h{i}"))) for i in range(2)]
    await asyncio.sleep(0.02)
    # the two holders keep their permits: nothing else can go
    assert rig.fc.pending == 2
    assert any(pending == 2 for _, pending in rig.detector.calls)
    for p in permits:
        p.release()
    rig.detector.value = 0.0
    await asyncio.gather(*tasks, *holders)
    assert len(rig.order) == 6


async def test_usage_limit_gates_lower_bands_and_stops_the_cycle() -> None:
    policy = Ceilings({0: 0.5})
    rig = Rig(FlowControlSettings(default_band=band(), usage_limit=policy), Detector(value=0.6))
    t_hi = rig.start(request("hi", priority=1))
    t_lo = rig.start(request("lo", priority=0))
    await asyncio.wait_for(t_hi, 1)
    await asyncio.sleep(0.02)
    assert rig.order == ["hi"] and rig.fc.queued == 1  # 0.6 >= 0.5: band 0 gated
    assert [0] in policy.seen
    rig.detector.value = 0.4
    await asyncio.wait_for(t_lo, 1)
    assert rig.order == ["hi", "lo"]


async def test_band_and_global_capacity_reject_with_429_saturated_or_503_without_endpoints() -> None:
    settings = FlowControlSettings(default_band=band(max_requests=2), max_bytes=25)
    rig = Rig(settings, Detector(value=1.0))
    tasks = [rig.start(request("a")), rig.start(request("b"))]
    await settle()
    with pytest.raises(InferenceError) as info:
        await rig.fc.admit(request("c"), 0.0)
    assert info.value.code.http_status == 429 and reason(info.value) == "rejected-saturated"
    other = FlowControlSettings(default_band=band(), max_bytes=25)
    rig2 = Rig(other, Detector(value=1.0))
    t = rig2.start(request("a", size=20))
    await settle()
    with pytest.raises(InferenceError) as info:
        await rig2.fc.admit(request("b", size=10), 0.0)  # 20 + 10 > 25 bytes
    assert reason(info.value) == "rejected-saturated"
    rig2.pool.clear()
    with pytest.raises(InferenceError) as info:
        await rig2.fc.admit(request("c", size=10), 0.0)
    assert info.value.code.http_status == 503 and reason(info.value) == "rejected-no-endpoints"
    rig.fc.close()
    rig2.fc.close()
    await asyncio.gather(*tasks, t)


async def test_ttl_expiry_is_429_with_endpoints_and_503_without() -> None:
    settings = FlowControlSettings(default_band=band(), request_ttl=0.03, no_endpoint_ttl=0.03)
    rig = Rig(settings, Detector(value=1.0))
    before = fcm.REQUESTS_TOTAL.labels("EvictedTTL", "0", "pool").value
    await rig.start(request("r"))
    err = rig.errors["r"]
    assert err.code.http_status == 429 and reason(err) == "rejected-ttl-expired"
    assert fcm.REQUESTS_TOTAL.labels("EvictedTTL", "0", "pool").value == before + 1
    rig.pool.clear()
    await rig.start(request("s"))
    err = rig.errors["s"]
    assert err.code.http_status == 503 and reason(err) == "rejected-no-endpoints"
    assert rig.fc.queued == 0


async def test_an_empty_pool_holds_requests_for_the_no_endpoint_budget_and_endpoints_release_them() -> None:
    settings = FlowControlSettings(default_band=band(), request_ttl=0.05, no_endpoint_ttl=5.0)
    rig = Rig(settings)
    rig.pool.clear()
    task = rig.start(request("r"))
    await asyncio.sleep(0.12)  # well past defaultRequestTTL: the no-endpoint budget applies
    assert rig.fc.queued == 1 and not rig.errors
    rig.pool.append(endpoint("c", "10.0.0.3"))  # scale-up: the request goes
    await asyncio.wait_for(task, 1)
    assert rig.order == ["r"]


async def test_the_budget_restarts_when_the_pool_fills_again() -> None:
    settings = FlowControlSettings(default_band=band(), request_ttl=0.1, no_endpoint_ttl=5.0)
    rig = Rig(settings, Detector(value=1.0))
    rig.pool.clear()
    task = rig.start(request("r"))
    await asyncio.sleep(0.15)  # longer than request_ttl, spent without endpoints
    rig.pool.append(endpoint("c", "10.0.0.3"))
    await asyncio.sleep(0.05)  # endpoints back (saturated) for less than request_ttl: still waiting
    assert rig.fc.queued == 1 and not rig.errors
    await asyncio.wait_for(task, 1)  # then the TTL, charged from the change, runs out
    assert reason(rig.errors["r"]) == "rejected-ttl-expired"


async def test_a_cancelled_waiter_leaves_the_queue_at_once() -> None:
    rig = Rig(detector=Detector(value=1.0))
    before = fcm.REQUESTS_TOTAL.labels("EvictedContextCancelled", "0", "pool").value
    task = rig.start(request("gone"))
    other = rig.start(request("stays"))
    await settle()
    task.cancel()
    await settle()
    assert rig.fc.queued == 1
    assert fcm.REQUESTS_TOTAL.labels("EvictedContextCancelled", "0", "pool").value == before + 1
    rig.detector.value = 0.0
    await asyncio.wait_for(other, 1)
    assert rig.order == ["stays"] and rig.fc.pending == 0


async def test_close_rejects_queued_and_later_requests_with_shutting_down() -> None:
    rig = Rig(detector=Detector(value=1.0))
    task = rig.start(request("queued"))
    await settle()
    rig.fc.close()
    await task
    assert rig.errors["queued"].code.http_status == 503
    assert reason(rig.errors["queued"]) == "rejected-shutting-down"
    with pytest.raises(InferenceError) as info:
        await rig.fc.admit(request("late"), 0.0)
    assert reason(info.value) == "rejected-shutting-down"


async def test_prefill_and_decode_stages_gate_on_the_busier_stage() -> None:
    rig = Rig()
    rig.pool[:] = [
        endpoint("p", "10.0.0.1", labels={"llm-d.ai/role": "prefill"}),
        endpoint("d", "10.0.0.2", labels={"llm-d.ai/role": "decode"}),
        endpoint("x", "10.0.0.3", labels={"llm-d.ai/role": "prefill-decode"}),
        endpoint("e", "10.0.0.4", labels={"llm-d.ai/role": "encode"}),
    ]
    (await rig.fc.admit(request("r"), 0.0)).release()
    assert sorted(n for n, _ in rig.detector.calls) == [2, 2]  # prefill+interleaved, decode+interleaved
    assert fcm.POOL_SATURATION.labels("pool", "prefill").value == 0.0


async def test_failing_policies_and_detectors_do_not_stall_the_queue() -> None:
    rig = Rig(FlowControlSettings(default_band=band(fairness=Broken("broken", None))), Detector(value=1.0))
    task = rig.start(request("r"))
    await settle()
    rig.detector.fail = True  # treated as unsaturated, logged
    rig.detector.value = 0.0
    await asyncio.wait_for(task, 1)
    assert rig.order == ["r"]


async def test_eviction_revokes_the_newest_lowest_priority_in_flight_request_one_at_a_time() -> None:
    settings = FlowControlSettings(default_band=band(), eviction=True)
    rig = Rig(settings, Detector(value=1.0))
    rig.detector.reclaim_grace = 0.0  # type: ignore[misc]
    revoked: list[str] = []
    assert rig.fc.track(0, lambda: revoked.append("critical")) is None  # only sheddable ones
    old = rig.fc.track(-1, lambda: revoked.append("old-1"))
    new = rig.fc.track(-1, lambda: revoked.append("new-1"))
    lowest = rig.fc.track(-5, lambda: revoked.append("new-5"))
    assert old is not None and new is not None and lowest is not None
    waiting = rig.start(request("critical", priority=0))
    await asyncio.sleep(0.03)
    assert revoked == ["new-5"]  # lowest priority first; the next waits for its stream to end
    rig.fc.untrack(lowest)
    await asyncio.sleep(0.03)
    assert revoked == ["new-5", "new-1"]  # then the newest dispatch
    before = fcm.REVOCATIONS.labels("confirmed", "pool").value
    rig.fc.untrack(new)
    assert fcm.REVOCATIONS.labels("confirmed", "pool").value == before + 1
    rig.detector.value = 0.0  # the freed capacity shows
    await asyncio.wait_for(waiting, 1)
    assert rig.order == ["critical"] and revoked == ["new-5", "new-1"]
    rig.fc.untrack(old)


async def test_eviction_off_revokes_nothing() -> None:
    rig = Rig(detector=Detector(value=1.0))
    assert rig.fc.track(-1, lambda: None) is None
    task = rig.start(request("critical"))
    await asyncio.sleep(0.02)
    rig.fc.close()
    await task


async def test_with_eviction_sheddable_requests_give_way_to_blocked_demand() -> None:
    settings = FlowControlSettings(default_band=band(), eviction=True)
    rig = Rig(settings, Detector(value=1.0))
    queued_sheddable = rig.start(request("batch", priority=-1))
    await settle()
    assert rig.fc.queued == 1  # alone it waits (nothing above it is blocked)
    critical = rig.start(request("critical", priority=0))
    await asyncio.sleep(0.02)
    await queued_sheddable
    assert rig.errors["batch"].code.http_status == 429
    assert reason(rig.errors["batch"]) == "rejected-saturated"
    with pytest.raises(InferenceError) as info:  # and new ones are turned away at once
        await rig.fc.admit(request("late", priority=-1), 0.0)
    assert reason(info.value) == "rejected-saturated"
    assert rig.fc.queued == 1
    rig.detector.value = 0.0
    await asyncio.wait_for(critical, 1)
    assert rig.order == ["critical"]


class Slots(Detector):
    """``capacity`` requests in flight saturate the pool (the test moves ``inflight``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.inflight = 0

    def dispatch_saturation(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        return (self.inflight + pending) / self.capacity


async def test_a_flow_over_its_share_leaves_the_last_slot_to_the_bands_other_flows() -> None:
    from epp.plugins.flow_control.round_robin import RoundRobinFairnessPolicy

    rr = RoundRobinFairnessPolicy("rr", None)
    slots = Slots(capacity=4)
    rig = Rig(FlowControlSettings(default_band=band(fairness=rr)), slots)

    async def take(name: str, flow: str) -> Any:
        permit = await rig.fc.admit(request(name, flow=flow), 0.0)
        permit.release()
        slots.inflight += 1
        return permit

    light = await take("light-1", "light")
    heavy = [await take(f"heavy-{i}", "heavy") for i in range(2)]
    queued = asyncio.ensure_future(take("heavy-2", "heavy"))  # room for one more: kept
    await asyncio.sleep(0.02)
    assert not queued.done() and rig.fc.queued == 1 and slots.inflight == 3
    second_light = await asyncio.wait_for(take("light-2", "light"), 1)  # finds the room at once
    assert slots.inflight == 4
    # the light flow goes idle: the heavy one may use everything
    for p in (light, second_light):
        p.done()
        slots.inflight -= 1
    await asyncio.wait_for(queued, 1)
    assert slots.inflight == 3 and rig.fc.queued == 0
    for p in heavy:
        p.done()


async def test_a_flow_under_its_share_goes_before_one_over_it_only_for_share_aware_policies() -> None:
    from epp.plugins.flow_control.global_strict import GlobalStrictFairnessPolicy
    from epp.plugins.flow_control.round_robin import RoundRobinFairnessPolicy

    for policy, first in (
        (RoundRobinFairnessPolicy("rr", None), "light-1"),  # balanced: the light flow goes first
        (GlobalStrictFairnessPolicy("strict", None), "heavy-9"),  # FCFS across flows: arrival order
    ):
        slots = Slots(capacity=4)
        rig = Rig(FlowControlSettings(default_band=band(fairness=policy)), slots)
        held = []
        for name, flow in (
            ("heavy-0", "heavy"),
            ("heavy-1", "heavy"),
            ("heavy-2", "heavy"),
            ("light-0", "light"),
        ):
            permit = await asyncio.wait_for(rig.fc.admit(request(name, flow=flow), 0.0), 1)
            permit.release()  # routed: in flight from here
            slots.inflight += 1
            held.append(permit)
        # full: heavy 3, light 1
        tasks = [rig.start(request("heavy-9", flow="heavy"))]
        await settle()
        tasks.append(rig.start(request("light-1", flow="light")))
        await settle()
        held.pop(0).done()  # one heavy request ends: one slot frees
        slots.inflight -= 1
        await asyncio.sleep(0.02)
        assert rig.order[:1] == [first], (policy.type_name, rig.order)
        rig.fc.close()
        await asyncio.gather(*tasks)


async def test_a_full_band_pushes_out_the_flooding_flow_for_a_flow_under_its_share() -> None:
    rig = Rig(FlowControlSettings(default_band=band(max_requests=4)), Detector(value=1.0))
    flood = [rig.start(request(f"f{i}", flow="flood")) for i in range(4)]
    await settle()
    assert rig.fc.queued == 4
    with pytest.raises(InferenceError) as info:  # the flooding flow itself is refused at the cap
        await rig.fc.admit(request("f4", flow="flood"), 0.0)
    assert reason(info.value) == "rejected-saturated"
    steady = [rig.start(request(f"s{i}", flow="steady")) for i in range(2)]
    await settle()
    # the flood's newest two made room; the steady flow holds 2 of the 4 places, the flood 2
    assert sorted(rig.errors) == ["f2", "f3"]
    assert all(e.code.http_status == 429 and reason(e) == "rejected-saturated" for e in rig.errors.values())
    assert "fair share" in str(rig.errors["f3"])
    with pytest.raises(InferenceError):  # at an even split nobody is pushed out
        await rig.fc.admit(request("s2", flow="steady"), 0.0)
    assert rig.fc.queued == 4
    rig.detector.value = 0.0
    rig.fc.kick()
    await asyncio.wait_for(asyncio.gather(*flood, *steady), 1)
    assert sorted(rig.order) == ["f0", "f1", "s0", "s1"]


async def test_the_effective_saturation_gauge_follows_the_pool_when_nothing_is_queued() -> None:
    rig = Rig(detector=Detector(value=0.9))
    gauge = fcm.POOL_SATURATION.labels("pool", "effective")
    permit = await rig.fc.admit(request("r"), 0.0)
    assert gauge.value == 0.9  # the dispatch cycle of the arrival
    permit.release()
    rig.detector.value = 0.1  # the engines drained; no request comes, so no dispatch cycle runs
    permit.done()
    await asyncio.sleep(0.2)
    assert gauge.value == 0.1
    rig.fc.close()
