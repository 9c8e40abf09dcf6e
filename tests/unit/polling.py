"""Bounded polling for tests of asynchronous work: wait until a condition holds, or fail."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(
    condition: Callable[[], object],
    timeout: float = 10.0,
    state: Callable[[], str] = lambda: "",
    *,
    interval: float = 0.01,
) -> float:
    """Poll ``condition()`` every ``interval`` seconds until it is true; returns the seconds waited.

    The bound is a safety net, not an assertion: past ``timeout`` an AssertionError with ``state()``.
    """
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met in {timeout} s; {state()}")
        await asyncio.sleep(interval)
    return time.monotonic() - start
