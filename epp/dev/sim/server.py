"""Serving the simulator: :class:`SimServer` runs one app on a port, :class:`SimCluster` one per
data-parallel rank."""

from __future__ import annotations

import asyncio
import dataclasses

import structlog
from aiohttp import web

from epp.dev.sim.app import build_app, build_side_app
from epp.dev.sim.block_hash import int_hashes_from_env
from epp.dev.sim.context import ENGINE_KEY, PUBLISHER_KEY
from epp.dev.sim.engine import Engine, SimConfig
from epp.dev.sim.kv_events import ZmqEventPublisher
from epp.dev.sim.metrics import dcgm_metrics, metrics

log = structlog.get_logger("epp.sim")


class SimServer:
    """Serves one simulator app on ``config.host:config.port`` (port 0 picks a free port).

    Handlers are cancelled when their client disconnects, so a dropped request frees its slot at once.
    Usable as ``async with SimServer(config) as sim: ... sim.url ...``.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.app = build_app(config)
        self.port = config.port
        self._runner: web.AppRunner | None = None
        self._side: list[web.AppRunner] = []
        self.publisher: ZmqEventPublisher | None = None

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE_KEY]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, keepalive_timeout=self.config.keep_alive
        )
        await runner.setup()
        await web.TCPSite(runner, self.config.host, self.config.port).start()
        self._runner = runner
        self.port = _bound_port(runner, self.config.port)
        pod = self.config.pod_name(self.port)
        self._start_kv_events(pod)
        for side_port, handler in (
            (self.config.metrics_port, metrics),
            (self.config.dcgm_port, dcgm_metrics),
        ):
            if side_port:
                side = web.AppRunner(build_side_app(self.app, handler, pod), access_log=None)
                await side.setup()
                self._side.append(side)
                await web.TCPSite(side, self.config.host, side_port).start()
        log.info("sim.started", url=self.url, pod=self.config.pod_name(self.port), model=self.config.model)

    def _start_kv_events(self, pod: str) -> None:
        """Start the KV-event publisher (if enabled); its default topic is vLLM's, ``""``."""
        events = self.config.kv_events_config
        if events is None or not events.enabled:
            return
        topic = events.topic if events.topic is not None else ""
        self.publisher = ZmqEventPublisher(
            events,
            topic=topic,
            block_size=self.config.block_size,
            data_parallel_rank=self.config.data_parallel_rank,
            encoding=self.config.kv_events_encoding,
            layout=self.config.kv_events_layout,
            int_hashes=int_hashes_from_env(),
            replay_format=self.config.kv_events_replay_format,
            listen_host=self.config.host,
        )
        self.app[PUBLISHER_KEY].publisher = self.publisher
        self.engine.kv_event_sink = self.publisher.publish
        log.info(
            "sim.kv_events",
            endpoint=self.publisher.endpoint,
            replay=self.publisher.replay_endpoint,
            topic=topic,
        )

    async def stop(self) -> None:
        for side in self._side:
            await side.cleanup()
        self._side.clear()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            self.app[PUBLISHER_KEY].publisher = None
            self.engine.kv_event_sink = None
            await asyncio.to_thread(publisher.close)

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback


def rank_configs(config: SimConfig) -> list[SimConfig]:
    """One config per data-parallel rank: rank ``i`` listens on ``port + i`` (any free port if 0)."""
    step = 1 if config.port else 0
    return [
        dataclasses.replace(
            config,
            port=config.port + rank * step,
            metrics_port=config.metrics_port + rank if config.metrics_port else 0,
            dcgm_port=config.dcgm_port + rank if config.dcgm_port else 0,
            data_parallel_size=1,
            data_parallel_rank=rank,
        )
        for rank in range(config.data_parallel_size)
    ]


class SimCluster:
    """``data_parallel_size`` independent simulators (ranks), each with its own engine, cache and metrics.

    Usable as ``async with SimCluster(config) as cluster: ... cluster.servers[i].url ...``.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.servers = [SimServer(rank) for rank in rank_configs(config)]

    async def start(self) -> None:
        try:
            for server in self.servers:
                await server.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for server in reversed(self.servers):
            await server.stop()

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()
