"""Run a coroutine eagerly: in the caller, with no task and no timer, until it first suspends.

Most plugin coroutines (``DataProducer.produce``) never suspend; starting them eagerly lets the
director put a timeout around only those that do.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any


class _Rest:
    """Awaits the rest of a coroutine that suspended on ``pending`` (what it yielded to the task)."""

    __slots__ = ("coro", "pending")

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self.coro = coro
        self.pending = pending

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, pending = self.coro, self.pending
        while True:
            try:
                sent = yield pending
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation (or a timeout) goes into the coroutine
                try:
                    pending = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    pending = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


def start(coro: Coroutine[Any, Any, Any]) -> _Rest | None:
    """Run ``coro`` to its first suspension: None if it finished (its exception propagates), else an
    awaitable that runs the rest in the awaiting task."""
    try:
        pending = coro.send(None)
    except StopIteration:
        return None
    return _Rest(coro, pending)
