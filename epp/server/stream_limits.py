"""Limits on ext_proc streams in their request phase: an idle timeout and a global body budget."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from epp.promlite import Value


class Watched(Protocol):
    """What the sweeper needs of a stream."""

    last_seen: float  # time.monotonic() of the last request-phase message
    task: asyncio.Task[Any] | None  # the task serving the stream (set by ``watch``)

    def expire(self) -> None:
        """Cut the stream: the idle timeout elapsed."""


class RequestPhaseLimits:
    """Server-wide state of the idle timeout (0 = none) and the body budget (0 = unlimited).

    One sweeper task, alive only while some stream is in its request phase, wakes every ``interval``
    seconds and expires the late ones: a stream pays a timestamp per message and a set insertion and
    removal, no timer of its own. The timeout never applies once the request is routed.
    """

    __slots__ = ("_loop", "_sweeper", "_waiting", "budget", "buffered", "gauge", "idle_timeout", "interval")

    def __init__(
        self, idle_timeout: float = 60.0, budget: int = 256 << 20, gauge: Value | None = None
    ) -> None:
        self.idle_timeout = idle_timeout
        self.budget = budget
        self.buffered = 0  # request-body bytes held by streams waiting for more of their body
        self.gauge = gauge or Value()  # mirrors ``buffered`` (a metric)
        # Streams are cut between idle_timeout and idle_timeout + interval after their last message.
        self.interval = min(1.0, max(0.05, idle_timeout / 4))
        self._waiting: set[Watched] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the sweeper's (the server's) loop

    # --- idle timeout ------------------------------------------------------------------------

    def watch(self, stream: Watched) -> None:
        """``stream``, served by the current task, entered its request phase."""
        if self.idle_timeout <= 0:
            return
        if self._sweeper is None:
            self._loop = loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweep(), name="extproc-idle-sweeper")
        stream.task = asyncio.current_task(self._loop)  # the loop given: no lookup of the running one
        self._waiting.add(stream)

    def unwatch(self, stream: Watched) -> None:
        """``stream`` left its request phase (routed, or ended)."""
        self._waiting.discard(stream)

    @property
    def watched(self) -> int:
        """Streams in their request phase."""
        return len(self._waiting)

    @property
    def sweeping(self) -> bool:
        """Whether the sweeper task is alive."""
        return self._sweeper is not None

    async def _sweep(self) -> None:
        waiting = self._waiting
        try:
            while waiting:
                await asyncio.sleep(self.interval)
                deadline = time.monotonic() - self.idle_timeout
                late = [s for s in waiting if s.last_seen <= deadline]
                for stream in late:
                    waiting.discard(stream)
                    stream.expire()
        finally:
            self._sweeper = None

    async def close(self) -> None:
        """Stop the sweeper (server shutdown)."""
        task = self._sweeper
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    # --- body budget -------------------------------------------------------------------------

    def reserve(self, size: int) -> bool:
        """Hold ``size`` more body bytes; ``False`` (nothing held) when that would exceed the budget."""
        held = self.buffered + size
        if self.budget and held > self.budget:
            return False
        self.buffered = self.gauge.value = held
        return True

    def release(self, size: int) -> None:
        self.buffered -= size
        self.gauge.value = self.buffered
