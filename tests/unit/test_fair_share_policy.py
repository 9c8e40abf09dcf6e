"""``fair-share-fairness-policy``: per-flow in-flight caps from the pool's measured capacity.

The policy on a real ``Band`` (caps, reserve, the active window, the rotation), its parameters
through the config loader, and the flow controller measuring the capacity and holding a flood at
its share so that a light tenant's burst dispatches at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from epp.flowcontrol import FlowControlSettings
from epp.flowcontrol.band import Band
from epp.flowcontrol.queue import Queued
from epp.flowcontrol.settings import BandSettings
from epp.framework import FairnessPolicy, FlowKey
from epp.plugins.flow_control import fair_share
from epp.plugins.flow_control.fair_share import FairShareFairnessPolicy, FairShareParams
from epp.plugins.flow_control.fcfs import FcfsOrderingPolicy
from epp.plugins.flow_control.round_robin import RoundRobinFairnessPolicy
from tests.unit import factories
from tests.unit.factories import config as load
from tests.unit.factories import config_error as load_error
from tests.unit.test_flow_controller import Rig, Slots, band, request


def real_band(policy: FairnessPolicy) -> Band:
    fifo = FcfsOrderingPolicy("fifo", None)
    return Band(0, BandSettings(0, 0, policy, fifo), policy, fifo)


def queue(b: Band, flow: str, n: int = 1) -> None:
    for i in range(n):
        item = Queued(
            request=factories.request(request_id=f"{flow}-{i}"),
            key=FlowKey(flow, 0),
            byte_size=10,
            seq=i,
            enqueued_at=float(i),
            received_at=float(i),
            ttl=0.0,
        )
        item.sort_key = (float(i),)
        b.push(item)


def in_flight(b: Band, flow: str, n: int) -> None:
    for _ in range(n):
        b.started(flow)


def served(b: Band, policy: FairnessPolicy, flow: str, n: int) -> None:
    """``n`` requests of ``flow`` queued, dispatched through ``policy`` and in flight."""
    for _ in range(n):
        queue(b, flow)
        fq = b.flow(flow)
        assert fq is not None
        item = b.pop(fq)
        policy.dispatched(b, item)
        b.started(flow)


def test_a_flood_over_its_share_is_capped_and_the_light_flow_is_picked() -> None:
    policy = FairShareFairnessPolicy("fs", None)
    b = real_band(policy)
    in_flight(b, "flood", 6)
    in_flight(b, "light", 1)
    queue(b, "flood", 3)
    queue(b, "light", 1)
    caps = policy.flow_caps(b, 8.0)
    # share 4 each; the light flow's unused 3 stay reserved: the flood may hold 8 - 4 = 4; the
    # light flow, with less backlog, asks for less than the band's mean and has no cap
    assert caps == {"flood": 4.0}
    picked = policy.pick(b)
    assert picked is not None and picked.key.id == "light"
    b.pop(b.flow("light"))  # type: ignore[arg-type]
    assert policy.pick(b) is None  # the flood is at its cap: nothing else may go


def test_reserve_zero_lets_the_flood_use_the_light_flows_idle_share() -> None:
    policy = FairShareFairnessPolicy("fs", FairShareParams(reserve=0.0))
    b = real_band(policy)
    in_flight(b, "flood", 4)
    in_flight(b, "light", 1)
    queue(b, "flood", 3)
    caps = policy.flow_caps(b, 8.0)
    assert caps == {"flood": 7.0}  # everything the light flow does not hold
    half = FairShareFairnessPolicy("fs", FairShareParams(reserve=0.5))
    hb = real_band(half)
    in_flight(hb, "flood", 4)
    in_flight(hb, "light", 1)
    queue(hb, "flood", 3)
    assert half.flow_caps(hb, 8.0) == {"flood": 5.5}  # half of the light flow's idle 3 is kept


def test_a_flow_alone_has_no_cap_and_nothing_is_capped_before_a_capacity_is_measured() -> None:
    policy = FairShareFairnessPolicy("fs", None)
    b = real_band(policy)
    in_flight(b, "flood", 20)
    queue(b, "flood", 5)
    assert policy.flow_caps(b, 8.0) is None  # work-conserving alone
    in_flight(b, "light", 1)
    assert policy.flow_caps(b, 0.0) is None  # no capacity measured yet
    assert policy.flow_caps(b, 8.0) == {"flood": 4.0}


def test_a_recently_served_flow_keeps_its_share_for_the_active_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(fair_share.time, "monotonic", lambda: now[0])
    policy = FairShareFairnessPolicy("fs", FairShareParams(active_window_seconds=2.0))
    b = real_band(policy)
    queue(b, "light", 1)
    item = b.pop(b.flow("light"))  # type: ignore[arg-type]
    policy.dispatched(b, item)  # served, and already finished: nothing queued or in flight
    served(b, policy, "flood", 3)
    queue(b, "flood", 2)
    now[0] += 1.0
    assert policy.flow_caps(b, 8.0) == {"flood": 4.0}  # the light flow's share is kept
    now[0] += 1.5
    assert policy.flow_caps(b, 8.0) is None  # idle past the window: the flood is alone
    no_window = FairShareFairnessPolicy("fs", FairShareParams(active_window_seconds=0.0))
    nb = real_band(no_window)
    queue(nb, "light", 1)
    no_window.dispatched(nb, nb.pop(nb.flow("light")))  # type: ignore[arg-type]
    served(nb, no_window, "flood", 3)
    queue(nb, "flood", 2)
    assert no_window.flow_caps(nb, 8.0) is None


def test_a_flow_asking_under_its_rate_share_is_uncapped_and_goes_first() -> None:
    policy = FairShareFairnessPolicy("fs", None)
    b = real_band(policy)
    served(b, policy, "flood", 6)
    served(b, policy, "light", 1)
    queue(b, "flood", 30)  # a flood's backlog is demand too
    queue(b, "light", 3)
    assert policy.flow_caps(b, 8.0) == {"flood": 4.0}  # the light flow has no cap
    for _ in range(3):  # past its in-flight share of 4: its rate and backlog are what count
        policy.flow_caps(b, 8.0)
        picked = policy.pick(b)
        assert picked is not None and picked.key.id == "light"
        b.pop(b.flow("light"))  # type: ignore[arg-type]
        b.started("light")
    policy.flow_caps(b, 8.0)
    assert policy.pick(b) is None  # the flood is over its cap of 4


def test_flows_under_their_caps_take_turns_in_id_order() -> None:
    policy = FairShareFairnessPolicy("fs", None)
    b = real_band(policy)
    for flow in ("c", "a", "b"):
        queue(b, flow, 2)
    order = []
    for _ in range(6):
        policy.flow_caps(b, 0.0)  # no caps: the rotation alone
        flow = policy.pick(b)
        assert flow is not None
        order.append(flow.key.id)
        b.pop(b.flow(flow.key.id))  # type: ignore[arg-type]
        b.started(flow.key.id)
    assert order == ["a", "b", "c"] * 2


def test_the_policy_loads_by_name_and_bad_parameters_name_the_field() -> None:
    cfg = load(
        """
featureGates: [flowControl]
plugins:
- {type: queue-scorer}
- {type: max-score-picker}
- {type: single-profile-handler}
- name: fair
  type: fair-share-fairness-policy
  parameters: {reserve: 0.5, activeWindowSeconds: 2, rateWindowSeconds: 5}
flowControl:
  defaultPriorityBand: {fairnessPolicyRef: fair}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""
    )
    fc = cfg.document.flow_control
    assert fc is not None and fc.default_priority_band is not None
    assert fc.default_priority_band.fairness_policy_ref == "fair"
    for params, key, reason in (
        ("{reserve: 1.5}", "reserve", "[0.0, 1.0]"),
        ("{reserve: -0.1}", "reserve", "[0.0, 1.0]"),
        ("{activeWindowSeconds: -1}", "activeWindowSeconds", "[0, 3600]"),
        ("{rateWindowSeconds: 0}", "rateWindowSeconds", "[0.01, 3600]"),
        ("{quantum: 3}", "quantum", "unknown parameter"),
    ):
        err = load_error(f"plugins:\n- {{type: fair-share-fairness-policy, parameters: {params}}}\n")
        assert err.field == f"plugins[0].parameters.{key}", params
        assert reason in err.reason, (params, err.reason)


@pytest.mark.parametrize(
    ("policy", "second_light_at_once"),
    [
        (FairShareFairnessPolicy("fs", None), True),
        (RoundRobinFairnessPolicy("rr", None), False),  # keeps only the last request's room
    ],
)
async def test_the_controller_holds_a_flood_at_its_share_so_a_light_burst_goes_at_once(
    policy: FairnessPolicy, second_light_at_once: bool
) -> None:
    slots = Slots(capacity=8)
    rig = Rig(FlowControlSettings(default_band=band(fairness=policy)), slots)
    held: list[Any] = []

    async def take(name: str, flow: str) -> None:
        permit = await rig.fc.admit(request(name, flow=flow), 0.0)
        permit.release()  # routed: in flight from here
        slots.inflight += 1
        held.append(permit)

    await take("light-0", "light")
    flood = [asyncio.ensure_future(take(f"flood-{i}", "flood")) for i in range(8)]
    await asyncio.sleep(0.05)
    if second_light_at_once:
        assert rig.fc.capacity == pytest.approx(8.0)  # measured from the saturation
        assert slots.inflight == 5 and rig.fc.queued == 4  # the flood holds its share of 4
    else:
        assert slots.inflight == 7 and rig.fc.queued == 2  # the flood leaves one slot
    burst = [asyncio.ensure_future(take(f"light-{i}", "light")) for i in (1, 2)]
    await asyncio.sleep(0.05)
    assert burst[0].done()
    assert burst[1].done() is second_light_at_once
    rig.fc.close()
    await asyncio.gather(*flood, *burst, return_exceptions=True)
    for p in held:
        p.done()


async def test_caps_lift_when_the_pool_turns_out_to_take_more() -> None:
    slots = Slots(capacity=8)
    rig = Rig(FlowControlSettings(default_band=band(fairness=FairShareFairnessPolicy("fs", None))), slots)
    held: list[Any] = []

    async def take(name: str, flow: str) -> None:
        permit = await rig.fc.admit(request(name, flow=flow), 0.0)
        permit.release()
        slots.inflight += 1
        held.append(permit)

    await take("light-0", "light")
    flood = [asyncio.ensure_future(take(f"flood-{i}", "flood")) for i in range(8)]
    await asyncio.sleep(0.05)
    assert slots.inflight == 5 and rig.fc.queued == 4  # held at the share of 8
    slots.capacity = 32  # the engines take more now: the pool is far from half saturated
    rig.fc.kick()
    await asyncio.wait_for(asyncio.gather(*flood), 1)  # no stale cap holds the flood
    assert slots.inflight == 9 and rig.fc.queued == 0
    for p in held:
        p.done()


def test_a_capped_flood_is_not_light_however_little_it_was_served() -> None:
    policy = FairShareFairnessPolicy("fs", None)
    b = real_band(policy)
    served(b, policy, "steady", 5)  # served more than the flood lately ...
    served(b, policy, "flood", 3)
    queue(b, "flood", 40)  # ... but the flood's backlog is its demand
    queue(b, "steady", 1)
    caps = policy.flow_caps(b, 16.0)
    assert caps == {"flood": 8.0}  # the steady flow is light: no cap, first
    picked = policy.pick(b)
    assert picked is not None and picked.key.id == "steady"
