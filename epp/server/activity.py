"""Requests and errors per endpoint over the last minute, as this EPP routed them (the status page):
per-second buckets in a fixed ring per endpoint address, one dictionary lookup per count."""

from __future__ import annotations

import time

WINDOW = 60  # seconds


class _Ring:
    __slots__ = ("errors", "requests", "seconds")

    def __init__(self) -> None:
        self.seconds = [-1] * WINDOW
        self.requests = [0] * WINDOW
        self.errors = [0] * WINDOW


class EndpointActivity:
    def __init__(self, clock: object = time.monotonic) -> None:
        self._clock = clock
        self._rings: dict[str, _Ring] = {}

    def _slot(self, hostport: str) -> tuple[_Ring, int]:
        now = int(self._clock())  # type: ignore[operator]
        ring = self._rings.get(hostport)
        if ring is None:
            if len(self._rings) >= 65536:  # bounded: addresses come and go
                self._rings.clear()
            ring = self._rings[hostport] = _Ring()
        i = now % WINDOW
        if ring.seconds[i] != now:
            ring.seconds[i], ring.requests[i], ring.errors[i] = now, 0, 0
        return ring, i

    def request(self, hostport: str) -> None:
        ring, i = self._slot(hostport)
        ring.requests[i] += 1

    def error(self, hostport: str) -> None:
        ring, i = self._slot(hostport)
        ring.errors[i] += 1

    def last_minute(self, hostport: str) -> tuple[int, int]:
        """(requests, errors) of the last ``WINDOW`` seconds."""
        ring = self._rings.get(hostport)
        if ring is None:
            return 0, 0
        now = int(self._clock())  # type: ignore[operator]
        cutoff = now - WINDOW
        if min(ring.seconds) > cutoff:  # steady traffic: every bucket is recent
            return sum(ring.requests), sum(ring.errors)
        if max(ring.seconds) <= cutoff:  # nothing this minute
            return 0, 0
        requests = errors = 0
        for s, r, e in zip(ring.seconds, ring.requests, ring.errors, strict=True):
            if now - s < WINDOW:
                requests += r
                errors += e
        return requests, errors
