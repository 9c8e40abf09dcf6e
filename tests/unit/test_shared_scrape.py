"""Replicas sharing the metrics scrape: the rendezvous assignment, and the ``endpoint-metrics``
value between two replicas' data layers (the owner publishes, the other installs and skips)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

from epp.datalayer.shared_scrape import SharedScrape, rendezvous_owner, valid_snapshot
from epp.datalayer.store import EndpointStore
from epp.framework import Metrics
from epp.framework.endpoint import SCRAPE_CONNECT_FAILURE
from tests.unit.factories import metadata

KEYS = [f"default/e{i}" for i in range(3000)]


def test_every_endpoint_has_one_owner_and_the_load_is_balanced() -> None:
    replicas = ["a", "b", "c"]
    owners = Counter(rendezvous_owner(k, replicas) for k in KEYS)
    assert set(owners) == set(replicas)
    assert all(800 < n < 1200 for n in owners.values()), owners
    # the order the peers are listed in does not matter
    assert all(rendezvous_owner(k, replicas) == rendezvous_owner(k, reversed(replicas)) for k in KEYS)


def test_a_replica_leaving_moves_only_its_endpoints_and_spreads_them() -> None:
    before = {k: rendezvous_owner(k, ["a", "b", "c"]) for k in KEYS}
    after = {k: rendezvous_owner(k, ["a", "b"]) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == "c" for k in moved) and len(moved) == sum(v == "c" for v in before.values())
    taken = Counter(after[k] for k in moved)
    assert taken["a"] > 300 and taken["b"] > 300, taken


def test_a_replica_joining_takes_only_the_endpoints_it_wins() -> None:
    before = {k: rendezvous_owner(k, ["a", "b"]) for k in KEYS}
    after = {k: rendezvous_owner(k, ["a", "b", "d"]) for k in KEYS}
    assert all(after[k] in (before[k], "d") for k in KEYS)
    assert 800 < sum(v == "d" for v in after.values()) < 1200


def _pair() -> tuple[EndpointStore, EndpointStore, SharedScrape, SharedScrape]:
    stores = (EndpointStore(), EndpointStore())
    for store in stores:
        for i in range(20):
            store.upsert(metadata(f"e{i}", "10.0.0.1", 8000 + i))
    live = {"a": frozenset({"b"}), "b": frozenset({"a"})}
    a = SharedScrape(stores[0], "a", lambda: live["a"], staleness=2.0, grace=0.5)
    b = SharedScrape(stores[1], "b", lambda: live["b"], staleness=2.0, grace=0.5)
    return stores[0], stores[1], a, b


def test_the_owner_publishes_the_other_installs_and_skips() -> None:
    store_a, store_b, a, b = _pair()
    now = time.monotonic()
    for e in store_a.endpoints():
        e.metrics = Metrics(
            waiting_queue_size=3,
            running_requests_size=5,
            kv_cache_usage_percent=0.5,
            update_time=now - 0.1,
            fresh_until=now + 1.9,
            loaded_adapters={"ad": "gpu", "cold": "cpu"},
            gpu_loaded_adapters=1,
            lora_residency=True,
        )
    published = a.spec().supply()
    owned_by_a = {e.metadata.key for e in store_a.endpoints() if a.owns(e)}
    assert set(published) == owned_by_a and 0 < len(owned_by_a) < 20
    assert all(valid_snapshot(v) for v in published.values())
    assert not valid_snapshot({**next(iter(published.values())), "w": -1})
    assert not valid_snapshot({**next(iter(published.values())), "la": {"ad": "disk"}})
    b.spec().install(published)
    for e in store_b.endpoints():
        if e.metadata.key in owned_by_a:
            assert (e.metrics.waiting_queue_size, e.metrics.running_requests_size) == (3, 5)
            assert e.metrics.lora_level("ad") == "gpu" and e.metrics.lora_level("cold") == "cpu"
            assert e.metrics.known(time.monotonic())
            assert 0.05 < time.monotonic() - e.metrics.update_time < 1.0  # the owner's age kept
            assert b.skip(e)  # a scrapes it
        else:
            assert e.metrics.update_time == 0.0 and not b.skip(e)  # b's own


def test_a_silent_owner_is_scraped_again_after_the_grace() -> None:
    store_a, store_b, a, b = _pair()
    for e in store_a.endpoints():
        e.metrics = Metrics(
            running_requests_size=1, update_time=time.monotonic(), fresh_until=time.monotonic() + 2
        )
    last = a.spec().supply()
    b.spec().install(last)
    theirs = [e for e in store_b.endpoints() if not b.owns(e)]
    assert theirs and all(b.skip(e) for e in theirs)
    time.sleep(0.6)  # a died: the mirror still holds its last snapshots, nothing newer comes
    b.spec().install(last)
    assert not any(b.skip(e) for e in theirs)


def test_a_refused_scrape_is_shared_as_down() -> None:
    store_a, store_b, a, b = _pair()
    e_a = next(e for e in store_a.endpoints() if a.owns(e))
    e_a.metrics = dataclasses.replace(e_a.metrics, failure=SCRAPE_CONNECT_FAILURE)
    b.spec().install(a.spec().supply())
    e_b = store_b.get(e_a.metadata.key)
    assert e_b is not None and e_b.metrics.down and e_b.metrics.update_time == 0.0


def test_the_same_scrape_published_again_keeps_its_time_and_the_owner_alive() -> None:
    # Plugins key their own state on update_time (the detector's credit marks): an unchanged
    # scrape must not look like a new one every sync round.
    store_a, store_b, a, b = _pair()
    now = time.monotonic()
    for e in store_a.endpoints():
        e.metrics = Metrics(running_requests_size=2, update_time=now, fresh_until=now + 2)
    b.spec().install(a.spec().supply())
    theirs = [e for e in store_b.endpoints() if not b.owns(e)]
    times = [e.metrics.update_time for e in theirs]
    time.sleep(0.3)
    b.spec().install(a.spec().supply())
    assert [e.metrics.update_time for e in theirs] == times
    time.sleep(0.3)  # past the grace since the first install: the second one kept the owner alive
    assert all(b.skip(e) for e in theirs)
