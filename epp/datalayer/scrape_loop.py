"""The data layer's own thread and event loop: scrapes, their parsing and pushed-load decoding run
there, never on the loop that serves requests. The request path reads what they wrote (each
endpoint's ``Metrics`` snapshot, replaced as a whole).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("epp.datalayer.scrape_loop")

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()


class ScrapeLoop:
    """A daemon thread running an event loop; ``submit`` schedules a coroutine there from any thread."""

    def __init__(self, name: str = "epp-datalayer") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        self.start()
        assert self._loop is not None
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        loop = self._loop = _new_loop()
        asyncio.set_event_loop(loop)
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the thread's loop; the returned future's ``cancel()`` cancels it there."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Any, *args: Any) -> None:
        """Call ``fn(*args)`` on the thread's loop (thread-safe)."""
        self.loop.call_soon_threadsafe(fn, *args)

    async def stop(self) -> None:
        """Stop the loop once its pending callbacks ran, and wait for the thread (off this loop)."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 5.0)
