"""The simulator-only ``GET /sim/stats`` (current and peak queue length and batch size, and the
``/metrics`` scrapes served) and ``POST /sim/stats/reset`` (start the peaks again), for benchmarks
that need an exact peak."""

from __future__ import annotations

from aiohttp import web

from epp.dev.sim.context import ENGINE_KEY, SCRAPES_KEY
from epp.dev.sim.engine import Engine, EnginePeaks
from epp.dev.sim.openai import json_response


def _stats(engine: Engine, peaks: EnginePeaks, scrapes: int) -> dict[str, int]:
    snap = engine.snapshot()
    return {
        "running": snap.running,
        "waiting": snap.waiting,
        "peak_running": peaks.running,
        "peak_waiting": peaks.waiting,
        "metrics_scrapes": scrapes,
    }


async def stats(request: web.Request) -> web.Response:
    """The queue and batch now, and their peaks since start or the last reset."""
    engine = request.app[ENGINE_KEY]
    return json_response(_stats(engine, engine.peaks(), request.app[SCRAPES_KEY][0]))


async def reset_stats(request: web.Request) -> web.Response:
    """Peaks start again from the current state; the answer carries the peaks before the reset."""
    engine = request.app[ENGINE_KEY]
    return json_response(_stats(engine, engine.reset_peaks(), request.app[SCRAPES_KEY][0]))
