"""Tests of the simulator-only peak tracking: ``Engine.peaks`` and ``GET``/``POST /sim/stats``.

Engine-level tests submit and abort sequences without consuming them (no sleeping); the HTTP test
runs a real server on 127.0.0.1 and holds requests in flight with a huge inter-token latency.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from epp.dev.sim.engine import Engine, QueueFullError, RequestSpec, SimConfig
from epp.dev.sim.server import SimServer

POLL_BOUND_S = 10.0


def _submit(engine: Engine, count: int, prefix: str = "r") -> list[Any]:
    return [engine.submit(RequestSpec(f"{prefix}{i}", "demo", prompt_tokens=1)) for i in range(count)]


async def test_peaks_keep_the_longest_queue_after_it_drains() -> None:
    engine = Engine(SimConfig(max_num_seqs=2))
    seqs = _submit(engine, 5)  # 2 running, 3 waiting
    for seq in seqs:
        engine.abort(seq)
    snap = engine.snapshot()
    assert (snap.running, snap.waiting) == (0, 0)
    peaks = engine.peaks()
    assert (peaks.waiting, peaks.running) == (3, 2)
    _submit(engine, 1, "late")  # a smaller burst later does not lower the peak
    assert engine.peaks().waiting == 3


async def test_reset_starts_the_peaks_from_the_current_state() -> None:
    engine = Engine(SimConfig(max_num_seqs=1))
    seqs = _submit(engine, 4)  # 1 running, 3 waiting
    engine.abort(seqs[3])
    engine.abort(seqs[2])
    before = engine.reset_peaks()
    assert (before.waiting, before.running) == (3, 1)
    assert (engine.peaks().waiting, engine.peaks().running) == (1, 1)  # what is queued now
    for seq in seqs:
        engine.abort(seq)
    engine.reset_peaks()
    assert (engine.peaks().waiting, engine.peaks().running) == (0, 0)


async def test_a_rejected_request_does_not_raise_the_peak() -> None:
    engine = Engine(SimConfig(max_num_seqs=1, max_waiting=2))
    _submit(engine, 3)
    with pytest.raises(QueueFullError):
        _submit(engine, 1, "over")
    assert engine.peaks().waiting == 2


async def _stats(session: aiohttp.ClientSession, url: str, method: str = "GET") -> dict[str, int]:
    path = "/sim/stats" if method == "GET" else "/sim/stats/reset"
    async with session.request(method, f"{url}{path}") as resp:
        assert resp.status == 200
        body: dict[str, int] = await resp.json()
        return body


async def test_sim_stats_endpoint_reports_the_peak_waiting_queue() -> None:
    config = SimConfig(port=0, max_num_seqs=1, time_to_first_token=0.0, inter_token_latency=3_600_000.0)
    server = SimServer(config)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "x", "max_tokens": 100, "stream": True}
            streams = [await session.post(f"{server.url}/v1/completions", json=body) for _ in range(3)]
            deadline = asyncio.get_running_loop().time() + POLL_BOUND_S
            while (stats := await _stats(session, server.url))["waiting"] < 2:
                assert asyncio.get_running_loop().time() < deadline, stats
                await asyncio.sleep(0.01)
            assert stats == {
                "running": 1,
                "waiting": 2,
                "peak_running": 1,
                "peak_waiting": 2,
                "metrics_scrapes": 0,
            }
            for resp in streams:
                resp.close()  # disconnects: the queue drains, the peak stays
            while (stats := await _stats(session, server.url))["running"] or stats["waiting"]:
                assert asyncio.get_running_loop().time() < deadline, stats
                await asyncio.sleep(0.01)
            assert (stats["peak_waiting"], stats["peak_running"]) == (2, 1)
            before = await _stats(session, server.url, "POST")
            assert before["peak_waiting"] == 2
            after = await _stats(session, server.url)
            assert (after["peak_waiting"], after["peak_running"]) == (0, 0)
    finally:
        await server.stop()
