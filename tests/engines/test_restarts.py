"""Engines and the EPP restarting under real vLLM: an engine killed with SIGKILL and started again
(its sequence numbers start over at 0), and the EPP restarted while the engines keep serving
(its index rebuilt from vLLM's replay sockets, more than vLLM's 1,000-message send high-water mark
per engine)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engines.harness import Engine, Front, Pool, prompt, start_front, total, wait_for
from tests.integration.harness import Rig


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _subscribed(front: Front, pool: Pool) -> None:
    wait_for(
        "a KV-event subscriber per engine",
        lambda: (
            total(front.epp_metrics(), "llm_d_epp_kv_cache_events_active_subscribers") >= len(pool.engines)
        ),
        timeout=30,
    )


# Events reach the EPP within milliseconds; a few seconds cover a loaded machine.
EVENTS_SETTLE = 3.0


def test_killed_engine_restarted_loses_its_old_blocks_and_keeps_its_first_batch(pool: Pool, rig: Rig) -> None:
    """An engine whose previous life published exactly one batch (sequence 0) is killed and started
    again: its first new batch (sequence 0 again) is indexed, and the blocks it lost never attract a
    request (they are on the other engine now, which must win)."""
    if not pool.ours:
        pytest.skip("EPP_ENGINE_URLS engines are not this test's to kill")
    victim, other = pool.engines[0], pool.engines[1]
    front = start_front(rig, pool)
    _subscribed(front, pool)
    # a fresh life with exactly one batch: sequence number 0
    pool.kill(victim)
    pool.restart(victim)
    wait_for("the EPP back on the restarted engine", lambda: _reconnected(front, pool), timeout=60)
    old = prompt(_tag(), blocks=4)
    victim.complete(old, pool.model)
    time.sleep(EVENTS_SETTLE)
    assert front.complete(old + " then")[0].name == victim.name  # indexed on the victim
    pool.kill(victim)
    pool.restart(victim)
    wait_for("the EPP back on the restarted engine", lambda: _reconnected(front, pool), timeout=60)
    first = prompt(_tag(), blocks=4)
    victim.complete(first, pool.model)  # the new life's sequence 0
    other.complete(old, pool.model)  # the lost blocks are now on the other engine only
    time.sleep(EVENTS_SETTLE)
    for _ in range(3):
        assert front.complete(first + f" {_tag()}")[0].name == victim.name, (
            "the restarted engine's first batch lost"
        )
        assert front.complete(old + f" {_tag()}")[0].name == other.name, (
            "blocks the engine lost attracted a request"
        )


def _reconnected(front: Front, pool: Pool) -> bool:
    return total(front.epp_metrics(), "llm_d_epp_kv_cache_events_active_subscribers") >= len(pool.engines)


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
    _subscribed(front, pool)
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
            _subscribed(front, pool)
            wait_for(
                "a replay answered per engine", lambda: _replays_done(front) >= len(pool.engines), timeout=60
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


def _replays_done(front: Front) -> float:
    page = front.epp_metrics()
    return sum(
        total(page, "llm_d_epp_kv_cache_events_replays_total", f'outcome="{o}"')
        for o in ("complete", "failed")
    )


def _keep_serving(engine: Engine, model: str, stop: threading.Event) -> None:
    while not stop.is_set():
        engine.complete(prompt(_tag(), blocks=1), model)
