"""Per-request plugin state needs no reaper (router v0.11's ``--plugin-state-staleness-threshold``):
the request-done hooks run whenever an ext_proc stream ends, also when Envoy resets it before any
response or an idle stream is cut, so state a plugin keeps per request is dropped with its stream."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from epp.datalayer.store import EndpointStore
from epp.framework import CycleState, LLMRequest, PreRequest, RequestDone, SchedulingResult
from epp.server.extproc import StreamOptions
from tests.unit import factories
from tests.unit.extproc_harness import body_msg, endpoint, headers_msg, start

CHAT = b'{"model":"demo","messages":[{"role":"user","content":"hi"}]}'


class _PerRequest(PreRequest, RequestDone):
    """Keeps an entry per routed request until its done hook."""

    type_name = "test-per-request-state"

    def __init__(self) -> None:
        super().__init__("per-request", None)
        self.state: dict[str, str] = {}
        self.routed = 0

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        self.state[request.request_id] = result.primary_profile_name
        self.routed += 1

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        del self.state[request.request_id]


async def _until(cond: object, what: str) -> None:
    for _ in range(300):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_state_of_reset_and_cut_streams_is_dropped_with_the_stream() -> None:
    store = EndpointStore()
    for i in (1, 2):
        store.upsert(endpoint(i))
    plugin = _PerRequest()
    director = factories.director(store, pre_request=[plugin])
    director.hooks = dataclasses.replace(director.hooks, request_done=[plugin])
    h = await start(store, director, StreamOptions(request_idle_timeout=0.2))
    try:
        calls = [h.stub.Process() for _ in range(3)]
        for call in calls:
            await call.write(headers_msg({}))
            await call.write(body_msg(CHAT, True))
            await call.read()  # routed: the plugin holds its entry
        assert plugin.routed == 3 and len(plugin.state) == 3
        calls[0].cancel()  # Envoy resets the stream before any response
        await _until(lambda: len(plugin.state) == 2, "the reset stream's state dropped")
        await calls[1].done_writing()  # Envoy half-closes without a response
        await _until(lambda: len(plugin.state) == 1, "the half-closed stream's state dropped")
        calls[2].cancel()
        await _until(lambda: not plugin.state, "every entry dropped")
        # a stream cut by the idle timeout before routing never took state
        idle = h.stub.Process()
        await idle.write(headers_msg({}))
        try:
            while await asyncio.wait_for(idle.read(), 5) is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError:
            pass
        assert await idle.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not plugin.state and plugin.routed == 3
    finally:
        await h.channel.close()
        await h.server.stop(0)
        await h.processor.close()
