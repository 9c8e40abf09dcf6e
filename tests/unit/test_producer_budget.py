"""The director's data producers: started eagerly, one shared budget for those that suspend."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from epp.datalayer.store import EndpointStore
from epp.framework import CycleState, DataProducer, Endpoint, LLMRequest
from epp.plugins.parsers.openai import OpenAIParser
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.profile_handlers.single import SingleProfileHandler
from epp.scheduling import Scheduler, SchedulerProfile
from epp.server import _eager
from epp.server import director as director_module
from epp.server.director import Director, DirectorHooks
from tests.unit.factories import metadata

PATH = {":path": "/v1/completions"}
BODY = orjson.dumps({"model": "m", "prompt": "hi"})


class _Recorder(DataProducer):
    """Records into the cycle state; ``sleep`` > 0 suspends that long, ``error`` is raised."""

    type_name = "test-recorder"

    def __init__(self, name: str, log: list[str], sleep: float = 0.0, error: BaseException | None = None):
        super().__init__(name, None)
        self.log, self.sleep, self.error = log, sleep, error
        self.cancelled = False

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        self.log.append(f"{self.name}:start")
        if self.sleep:
            try:
                await asyncio.sleep(self.sleep)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        if self.error is not None:
            raise self.error
        self.log.append(f"{self.name}:end")


def _director(*producers: DataProducer) -> Director:
    store = EndpointStore()
    store.upsert(metadata("e0"))
    profile = SchedulerProfile(name="default", picker=MaxScorePicker("max-score-picker", PickerParams()))
    scheduler = Scheduler(SingleProfileHandler("single-profile-handler", None), {"default": profile})
    return Director(store, OpenAIParser("openai-parser", None), scheduler, DirectorHooks(producers=producers))


async def test_producers_run_in_order_whether_or_not_they_suspend() -> None:
    log: list[str] = []
    d = _director(_Recorder("a", log), _Recorder("b", log, sleep=0.01), _Recorder("c", log))
    routing = await d.route(dict(PATH), BODY, {})
    assert routing.destination == "10.0.0.1:8000"
    assert log == ["a:start", "a:end", "b:start", "b:end", "c:start", "c:end"]


async def test_the_budget_cuts_a_slow_producer_and_skips_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(director_module, "PRODUCERS_BUDGET_SECONDS", 0.05)
    log: list[str] = []
    slow = _Recorder("slow", log, sleep=5.0)
    d = _director(_Recorder("a", log), slow, _Recorder("after", log))
    routing = await asyncio.wait_for(d.route(dict(PATH), BODY, {}), 2.0)
    assert routing.destination == "10.0.0.1:8000"  # the request is still routed
    assert slow.cancelled
    assert log == ["a:start", "a:end", "slow:start"]


async def test_a_producers_own_timeout_fails_only_that_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(director_module, "PRODUCERS_BUDGET_SECONDS", 5.0)
    log: list[str] = []
    d = _director(
        _Recorder("sync-timeout", log, error=TimeoutError("own")),
        _Recorder("async-timeout", log, sleep=0.01, error=TimeoutError("own")),
        _Recorder("after", log),
    )
    await d.route(dict(PATH), BODY, {})
    assert log == ["sync-timeout:start", "async-timeout:start", "after:start", "after:end"]


async def test_cancelling_the_request_cancels_a_suspended_producer() -> None:
    log: list[str] = []
    slow = _Recorder("slow", log, sleep=5.0)
    d = _director(slow)
    task = asyncio.ensure_future(d.route(dict(PATH), BODY, {}))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slow.cancelled


async def test_eager_start_returns_the_rest_only_for_a_coroutine_that_suspends() -> None:
    async def immediate() -> int:
        return 1

    async def suspends() -> int:
        await asyncio.sleep(0)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(fut.set_result, 41)
        return await fut + 1

    assert _eager.start(immediate()) is None
    rest: Any = _eager.start(suspends())
    assert rest is not None
    assert await rest == 42
