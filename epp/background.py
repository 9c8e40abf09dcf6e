"""``BackgroundTask``: the one long-running task a component owns (a watch loop, a refresher).

``RepeatingTask`` is one that calls a synchronous step every interval, logging a failing step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import structlog


class BackgroundTask:
    __slots__ = ("_factory", "_name", "_task")

    def __init__(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._name = name
        self._factory = factory
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._factory(), name=self._name)

    def cancel_now(self) -> None:
        """Cancel without waiting (a frozen process, in tests; or from synchronous code)."""
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class RepeatingTask(BackgroundTask):
    """Calls ``step()`` every ``interval()`` seconds; a step that raises is logged (``failure``),
    and the next one runs as planned."""

    __slots__ = ()

    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        interval: Callable[[], float],
        log: structlog.stdlib.BoundLogger,
        failure: str,
    ) -> None:
        async def run() -> None:
            while True:
                try:
                    step()
                except Exception:
                    log.exception(failure)
                await asyncio.sleep(interval())

        super().__init__(name, run)
