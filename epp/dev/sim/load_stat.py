"""SGLang's pushed load, simulated: a ZMQ PUB socket sending a msgpack ``LoadStat``
``["LoadStat", running, waiting, num_tokens, max_total_num_tokens, dp_rank]`` every interval
(``--load-publish-port``); ``POST /sim/load-stat/stop`` stops it while the engine keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import structlog
import zmq
from aiohttp import web

from epp.dev.sim.engine import Engine

log = structlog.get_logger("epp.dev.sim.load_stat")


def encode_load_stat(engine: Engine, rank: int | None) -> bytes:
    snap = engine.snapshot()
    capacity = engine.config.kv_capacity_tokens
    tokens = round(snap.kv_cache_usage * capacity)
    return msgspec.msgpack.encode(["LoadStat", snap.running, snap.waiting, tokens, capacity, rank])


class LoadStatPublisher:
    """Publishes the engine's load every ``interval`` seconds from a task of the serving loop."""

    def __init__(self, engine: Engine, host: str, port: int, interval: float, rank: int | None) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        bind_host = "*" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.bind(f"tcp://{bind_host}:{port}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._engine = engine
        self._interval = interval
        self._rank = rank
        self._task: asyncio.Task[None] | None = None
        self.sent = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="load-stat")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(zmq.Again):
                self._sock.send(encode_load_stat(self._engine, self._rank), zmq.NOBLOCK)
                self.sent += 1
            await asyncio.sleep(self._interval)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if not self._sock.closed:
            self._sock.close(0)

    @property
    def running(self) -> bool:
        return self._task is not None


LOAD_STAT_KEY = web.AppKey("load_stat_publisher", list)  # [LoadStatPublisher] or []


async def stop_load_stat(request: web.Request) -> web.Response:
    """Stop publishing (the engine keeps serving): a dead publisher, as seen by its subscribers."""
    slot = request.app[LOAD_STAT_KEY]
    if not slot:
        return web.json_response({"error": "no load publisher (see --load-publish-port)"}, status=409)
    await slot[0].stop()
    return web.json_response({"stopped": True, "sent": slot[0].sent})
