"""Engines and the EPP restarting under real vLLM: an engine killed with SIGKILL and started again
(its sequence numbers start over at 0), and the EPP restarted while the engines keep serving
(its index rebuilt from vLLM's replay sockets, more than vLLM's 1,000-message send high-water mark
per engine)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engines.harness import (
    EVENTS_TIMEOUT,
    Engine,
    Front,
    Pool,
    prompt,
    samples,
    start_front,
    total,
    wait_for,
)
from tests.integration.harness import Rig


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def test_killed_engine_restarted_loses_its_old_blocks_and_keeps_its_first_batch(pool: Pool, rig: Rig) -> None:
    """An engine whose life published exactly one batch (sequence 0) is killed and started again:
    its first new batch (sequence 0 again) is indexed, and the blocks it lost never attract a
    request (they are on the other engine now, which must win). The session runs this test first
    (conftest), on engines that have served nothing yet: one restart instead of two."""
    if not pool.ours:
        pytest.skip("EPP_ENGINE_URLS engines are not this test's to kill")
    victim, other = pool.engines[0], pool.engines[1]
    front = start_front(rig, pool)
    if victim.counter("vllm:request_success_total") > 0:
        _restart(front, victim)  # run alone or out of order: a fresh life first
    old = prompt(_tag(), blocks=4)
    before, received = front.admissions(), _received(front, victim)
    victim.complete(old, pool.model)  # one prefill: this life's only batch, sequence 0
    front.wait_indexed(before, 3, f"{victim.name}'s batch indexed")
    assert _received(front, victim) == received + 1, "the scenario needs a life of exactly one batch"
    _restart(front, victim)
    first = prompt(_tag(), blocks=4)
    before = front.admissions()
    victim.complete(first, pool.model)  # the new life's sequence 0
    front.wait_indexed(before, 3, "the restarted engine's first batch (sequence 0 again) indexed")
    before = front.admissions()
    other.complete(old, pool.model)  # the lost blocks are now on the other engine only
    front.wait_indexed(before, 3, "the other engine's batch indexed")
    for _ in range(3):
        assert front.complete(first + f" {_tag()}")[0].name == victim.name, (
            "the restarted engine's first batch lost"
        )
        assert front.complete(old + f" {_tag()}")[0].name == other.name, (
            "blocks the engine lost attracted a request"
        )


def _received(front: Front, engine: Engine) -> float:
    """Live KV-event batches the EPP received from ``engine`` since it started."""
    who = f'pod_identifier="default/{engine.name}"'
    return sum(
        v
        for labels, v in samples(front.epp_metrics(), "llm_d_epp_kv_cache_events_messages_received_total")
        if who in labels
    )


def _restart(front: Front, engine: Engine) -> None:
    """Kill ``engine`` and start it again; return once it serves and the EPP has dropped its old
    entries (a restart seen by the replayed last batch, or a failed check: cleared either way).
    Nothing goes through the EPP meanwhile: the restart is seen on the event stream alone."""
    clears = _restart_clears(front, engine)
    front.pool.kill(engine)
    front.pool.restart(engine)
    wait_for(
        f"the EPP to see {engine.name} restarted",
        lambda: _restart_clears(front, engine) > clears,
        timeout=EVENTS_TIMEOUT,
        interval=0.25,
    )


def _restart_clears(front: Front, engine: Engine) -> float:
    who = f'pod_identifier="default/{engine.name}"'
    return sum(
        v
        for labels, v in samples(front.epp_metrics(), "llm_d_epp_kv_cache_events_endpoint_clears_total")
        if who in labels  # a restart seen, or a verifying replay that failed: cleared either way
    )


REPLAY_BATCHES = 1300  # above vLLM's replay socket's default send high-water mark (1,000)


def _fill(engine: Engine, model: str, count: int, tags: list[str]) -> None:
    """``count`` one-token completions of distinct two-block prompts: one event batch each."""
    with ThreadPoolExecutor(2) as ex:
        for tag in ex.map(lambda _i: _one(engine, model), range(count)):
            tags.append(tag)


def _one(engine: Engine, model: str) -> str:
    tag = _tag()
    engine.complete(prompt(tag, blocks=2), model)
    return tag


def test_epp_restart_replays_over_a_thousand_batches_per_engine_while_engines_serve(
    pool: Pool, rig: Rig
) -> None:
    """The EPP restarts (several times) while the engines keep taking requests directly; each
    engine's replay of 1,300+ batches arrives whole: no endpoint cleared, the early prompts still
    routed to the engine that holds them."""
    front = start_front(rig, pool)
    held: dict[str, list[str]] = {e.name: [] for e in pool.engines}
    threads = [
        threading.Thread(target=_fill, args=(e, pool.model, REPLAY_BATCHES, held[e.name]))
        for e in pool.engines
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for round_ in range(3):
        stop = threading.Event()
        busy = [threading.Thread(target=_keep_serving, args=(e, pool.model, stop)) for e in pool.engines]
        for t in busy:
            t.start()
        try:
            front.restart_epp()
            for engine in pool.engines:
                wait_for(
                    f"the EPP's replay of {engine.name} answered",
                    lambda e=engine: _replays_done(front, e) >= 1,
                    timeout=EVENTS_TIMEOUT,
                    interval=0.25,
                )
        finally:
            stop.set()
            for t in busy:
                t.join()
        page = front.epp_metrics()
        assert total(page, "llm_d_epp_kv_cache_events_endpoint_clears_total") == 0, f"round {round_}: {page}"
        assert total(page, "llm_d_epp_kv_cache_events_replays_total", 'outcome="failed"') == 0, page
        for engine in pool.engines:
            for tag in (held[engine.name][5], held[engine.name][len(held[engine.name]) // 2]):
                served = front.complete(prompt(tag, blocks=2) + f" {_tag()}")[0]
                assert served.name == engine.name, (
                    f"round {round_}: {tag} is on {engine.name}, went to {served.name}"
                )


def _replays_done(front: Front, engine: Engine) -> float:
    return front.replays(engine, "complete") + front.replays(engine, "failed")


def _keep_serving(engine: Engine, model: str, stop: threading.Event) -> None:
    while not stop.is_set():
        engine.complete(prompt(_tag(), blocks=1), model)
