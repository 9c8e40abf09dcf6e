"""A least-recently-used map from text segments to their token ids, bounded by the UTF-8 size of
the segments it holds."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

DEFAULT_CACHE_BYTES = 32 * 1024 * 1024
"""The default bound: 32 MiB of cached segment text (about as much again of ids, 4 bytes each)."""


class SegmentCache:
    """``get`` marks a segment as recently used; ``put`` evicts the least recently used segments
    until the total text size is within ``max_bytes`` (a segment larger than the bound is not kept).
    Thread-safe."""

    __slots__ = ("_entries", "_lock", "bytes", "hits", "max_bytes", "misses")

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[array[int], int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, segment: str) -> bool:
        return segment in self._entries

    def get(self, segment: str) -> array[int] | None:
        with self._lock:
            entry = self._entries.get(segment)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(segment)
            self.hits += 1
            return entry[0]

    def put(self, segment: str, ids: array[int]) -> None:
        size = len(segment.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(segment, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[segment] = (ids, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
