"""Which endpoints had their ``Metrics`` replaced, in order.

``Endpoint`` notes every assignment of its ``metrics`` here (after the assignment). A reader that
keeps per-endpoint columns (the bulk scoring path) remembers the sequence number it last read and
asks for the endpoints noted since: it re-reads those few instead of all its candidates. The log
is bounded; a reader too far behind is told to re-read everything. Writers may be on any thread.
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import islice
from typing import Any

JOURNAL_SIZE = 16384


class MetricsJournal:
    """A bounded, ordered log of ``(sequence number, endpoint)``; numbers start at 1."""

    __slots__ = ("_lock", "_log", "_seq")

    def __init__(self, size: int = JOURNAL_SIZE) -> None:
        self._lock = threading.Lock()
        self._log: deque[tuple[int, Any]] = deque(maxlen=size)
        self._seq = 0

    @property
    def seq(self) -> int:
        """The last sequence number given (0: none yet)."""
        return self._seq

    def note(self, endpoint: Any) -> None:
        with self._lock:  # numbers and log order agree, whichever thread writes
            seq = self._seq + 1
            self._log.append((seq, endpoint))
            self._seq = seq

    def since(self, seq: int) -> tuple[int, list[Any] | None]:
        """``(last number, endpoints noted after seq)`` (oldest first, repeats kept); the list is
        None when the log no longer reaches back to ``seq``."""
        if self._seq == seq:
            return seq, []
        with self._lock:  # the newest entries only: O(changes), not O(log)
            last = self._seq
            count = last - seq
            if count > len(self._log) or count < 0:
                return last, None
            recent = list(islice(reversed(self._log), count))
        recent.reverse()
        return last, [e for _, e in recent]


JOURNAL = MetricsJournal()
"""The process's journal (every ``Endpoint`` notes here)."""
