"""Leader election on a Lease, against the fake API server's optimistic concurrency."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from epp.k8s.client import api_client
from epp.k8s.leader import LeaderElector, lease_name
from tests.fakekube import FakeKube
from tests.unit.polling import until

NS = "ns"
LEASE = lease_name(NS, "pool")


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as k:
        yield k


@pytest.fixture
async def apis(kube: FakeKube, tmp_path: Path) -> AsyncIterator[list[client.ApiClient]]:
    path = kube.write_kubeconfig(tmp_path / "kubeconfig")
    clients = [await api_client(str(path)) for _ in range(3)]
    yield clients
    for c in clients:
        await c.close()


def elector(api: client.ApiClient, identity: str, lease: float = 1.5, renew: float = 1.0) -> LeaderElector:
    return LeaderElector(
        api, NS, LEASE, identity, lease_duration=lease, renew_deadline=renew, retry_period=0.1
    )


def holder(kube: FakeKube) -> str:
    lease = kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)
    return "" if lease is None else lease["spec"].get("holderIdentity", "")


async def test_exactly_one_of_three_replicas_leads(kube: FakeKube, apis: list[client.ApiClient]) -> None:
    electors = [elector(api, f"epp-{i}") for i, api in enumerate(apis)]
    for e in electors:
        e.start()
    try:
        await until(lambda: any(e.is_leader for e in electors))
        await asyncio.sleep(0.5)  # several renew rounds: still exactly one
        leaders = [e for e in electors if e.is_leader]
        assert len(leaders) == 1
        assert holder(kube) == leaders[0].identity
        assert kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)["spec"]["leaseDurationSeconds"] == 2
    finally:
        for e in electors:
            await e.stop()


async def test_standby_takes_over_only_after_the_leader_stops_renewing(
    kube: FakeKube, apis: list[client.ApiClient]
) -> None:
    a, b = elector(apis[0], "a"), elector(apis[1], "b")
    changes: list[bool] = []
    b.on_change = changes.append
    a.start()
    await until(lambda: a.is_leader)
    b.start()
    await asyncio.sleep(0.3)
    assert not b.is_leader and holder(kube) == "a"
    # The leader freezes (no renewals, no release): as a hung or partitioned process would.
    a._task.cancel_now()
    frozen_at = time.monotonic()
    took = await until(lambda: b.is_leader)
    assert holder(kube) == "b" and changes == [True]
    # safety: the standby waited at least the lease duration since the last renewal it observed
    assert time.monotonic() - frozen_at >= 1.5 - 0.15, took
    lease = kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)
    assert lease["spec"]["leaseTransitions"] == 1
    a.is_leader = False  # the frozen one never released; don't let stop() write
    await b.stop()


async def test_graceful_stop_releases_the_lease_for_a_fast_handover(
    kube: FakeKube, apis: list[client.ApiClient]
) -> None:
    a, b = elector(apis[0], "a", lease=10.0, renew=5.0), elector(apis[1], "b", lease=10.0, renew=5.0)
    a.start()
    await until(lambda: a.is_leader)
    b.start()
    await asyncio.sleep(0.3)
    await a.stop()
    assert not a.is_leader
    took = await until(lambda: b.is_leader, timeout=5.0)  # far less than the 10 s lease
    assert holder(kube) == "b", took
    await b.stop()
    assert holder(kube) == ""


async def test_leader_steps_down_when_it_cannot_renew(kube: FakeKube, apis: list[client.ApiClient]) -> None:
    a = elector(apis[0], "a")
    changes: list[bool] = []
    a.on_change = changes.append
    a.start()
    await until(lambda: a.is_leader)
    kube.fail_next("GET", "/leases/", status=500, count=1000)
    await until(lambda: not a.is_leader)
    assert changes == [True, False]
    kube.fail_next("GET", "/leases/", status=500, count=0)
    await a.stop()


def test_invalid_timings_are_rejected() -> None:
    with pytest.raises(ValueError, match="lease duration > renew deadline > retry period"):
        LeaderElector(None, NS, LEASE, "x", lease_duration=5, renew_deadline=10, retry_period=2)  # type: ignore[arg-type]


async def test_a_replica_that_cannot_serve_never_leads_and_a_leader_that_stops_hands_over(
    kube: FakeKube, apis: list[client.ApiClient]
) -> None:
    a, b = elector(apis[0], "a"), elector(apis[1], "b")
    ready = {"a": False, "b": True}
    a.can_lead = lambda: ready["a"]
    b.can_lead = lambda: ready["b"]
    a.start()
    await asyncio.sleep(0.4)
    assert not a.is_leader and kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE) is None
    ready["a"] = True
    await until(lambda: a.is_leader)
    b.start()
    await asyncio.sleep(0.3)
    assert not b.is_leader
    ready["a"] = False  # e.g. its pool can no longer be listed: it releases, the ready one leads
    took = await until(lambda: b.is_leader and not a.is_leader, timeout=1.0)  # far below the lease
    assert holder(kube) == "b", took
    await a.stop()
    await b.stop()


async def test_the_replication_address_follows_the_holder(
    kube: FakeKube, apis: list[client.ApiClient]
) -> None:
    from epp.k8s.leader import ADDRESS_ANNOTATION

    a = LeaderElector(apis[0], NS, LEASE, "a", lease_duration=1.5, renew_deadline=1.0, retry_period=0.1,
                      advertise="10.0.0.1:9003")  # fmt: skip
    b = LeaderElector(apis[1], NS, LEASE, "b", lease_duration=1.5, renew_deadline=1.0, retry_period=0.1)
    a.start()
    await until(lambda: a.is_leader)
    b.start()
    await until(lambda: b.leader_address == "10.0.0.1:9003")
    await a.stop()  # released: the standby no longer points anywhere
    await until(lambda: b.is_leader)
    lease = kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)
    assert lease is not None and ADDRESS_ANNOTATION not in (lease["metadata"].get("annotations") or {})
    assert b.leader_address is None
    await b.stop()
