"""One flow's queue: a heap by the ordering policy's key, with removal of any item in O(1).

Removed items (expired, cancelled, shed) are marked and skipped when they reach the top, so the
live length and byte size are kept as counters.
"""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass

from epp.framework.flow import FlowKey, QueueItem


@dataclass(slots=True, eq=False)
class Queued(QueueItem):
    """A queued item with the controller's bookkeeping: its waiter, its TTL timer, its state."""

    future: asyncio.Future[None] | None = None
    timer: asyncio.TimerHandle | None = None
    gone: bool = False  # left the queue (dispatched, expired, cancelled, rejected)
    outcome: str = ""  # how it left


class FlowQueue:
    """The queued items of one flow (a ``FlowView`` for fairness policies)."""

    __slots__ = ("_bytes", "_heap", "_key", "_live")

    def __init__(self, key: FlowKey) -> None:
        self._key = key
        self._heap: list[tuple[tuple[float, ...], int, Queued]] = []
        self._live = 0
        self._bytes = 0

    @property
    def key(self) -> FlowKey:
        return self._key

    def __len__(self) -> int:
        return self._live

    @property
    def byte_size(self) -> int:
        return self._bytes

    def push(self, item: Queued) -> None:
        heapq.heappush(self._heap, (item.sort_key, item.seq, item))
        self._live += 1
        self._bytes += item.byte_size

    def peek(self) -> Queued:
        heap = self._heap
        while heap[0][2].gone:
            heapq.heappop(heap)
        return heap[0][2]

    def pop(self) -> Queued:
        item = self.peek()
        heapq.heappop(self._heap)
        item.gone = True
        self._live -= 1
        self._bytes -= item.byte_size
        return item

    def remove(self, item: Queued) -> None:
        """Take ``item`` out wherever it is (it must be queued here)."""
        item.gone = True
        self._live -= 1
        self._bytes -= item.byte_size
        if not self._live:
            self._heap.clear()

    def items(self) -> list[Queued]:
        return [entry[2] for entry in self._heap if not entry[2].gone]
