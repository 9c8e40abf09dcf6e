"""Engines that close idle keep-alive connections (vLLM's uvicorn: after 5 s) cost no request:
through a real Envoy (the generated bootstrap), the EPP and a simulator behind a relay that behaves
as such an engine's socket does when its close and a request cross."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from tests.integration.harness import Rig, Sim, chat_body, marker

pytestmark = pytest.mark.integration

KEEP_ALIVE = 4.5  # just above the bootstraps' idle timeout (4 s); vLLM's is 5 s
GAP = 4.8  # longer than the engine keeps an idle connection


class ClosingRelay:
    """A TCP relay to ``target``: on a connection that carried a response, a request arriving more
    than ``keep_alive`` s after the last byte finds the connection closed, unanswered (the engine
    closed it while the request was on its way)."""

    def __init__(self, target: int, keep_alive: float) -> None:
        self.target, self.keep_alive = target, keep_alive
        self.port = stack.free_port()
        self.closed_on_request = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        last, answered = time.monotonic(), False

        async def back() -> None:
            nonlocal last, answered
            while data := await up_r.read(65536):
                client_w.write(data)
                await client_w.drain()
                last, answered = time.monotonic(), True
            client_w.close()

        task = asyncio.ensure_future(back())
        try:
            while data := await client_r.read(65536):
                if answered and time.monotonic() - last > self.keep_alive:
                    self.closed_on_request += 1
                    break
                up_w.write(data)
                await up_w.drain()
                last = time.monotonic()
        finally:
            task.cancel()
            up_w.close()
            client_w.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_bootstraps_close_idle_engine_connections_before_the_engine_does() -> None:
    b = envoy_config.envoy_bootstrap(fail_open=True, fallback_endpoints=["127.0.0.1:8000"])
    clusters = {c["name"]: c for c in b["static_resources"]["clusters"]}
    for name in ("original_destination_cluster", "fallback_destination_cluster", "fallback_cluster"):
        opts = clusters[name]["typed_extension_protocol_options"]
        idle = opts["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["common_http_protocol_options"]
        assert float(idle["idle_timeout"].rstrip("s")) < KEEP_ALIVE < 5.0, name


def test_requests_after_idle_gaps_never_meet_a_closed_engine_connection(rig: Rig) -> None:
    (sim,) = rig.start_sims(1)
    relay = ClosingRelay(sim.port, KEEP_ALIVE)
    try:
        engine = Sim("engine", relay.port, sim.child)
        epp = rig.start_epp([engine])
        envoy = rig.start_envoy(epp)
        statuses = []
        for i in range(3):
            if i:
                time.sleep(GAP)
            resp = envoy.post("/v1/chat/completions", chat_body(marker()))
            statuses.append(resp.status)
        assert statuses == [200, 200, 200], (statuses, relay.closed_on_request)
        assert relay.closed_on_request == 0
    finally:
        relay.close()
