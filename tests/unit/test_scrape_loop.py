"""The data layer's own thread: scrapes go on while the serving loop is blocked, and the endpoints'
ticks are spread over the interval (jitter) instead of firing together."""

from __future__ import annotations

import threading
import time

from epp.datalayer.runtime import DataLayer
from epp.datalayer.store import EndpointStore
from epp.framework import DataSource, Endpoint, Extractor
from epp.framework.endpoint import Metrics
from epp.framework.interfaces import ExtractResult
from tests.unit.factories import metadata
from tests.unit.polling import until


class _Source(DataSource):
    """Records when (and on which thread) each endpoint was polled."""

    type_name = "recording-source"

    def __init__(self) -> None:
        super().__init__("recording", None)
        self.polls: list[tuple[str, float, int]] = []

    def poller(self, endpoint: Endpoint) -> _Poller:
        return _Poller(self, endpoint.metadata.key)


class _Poller:
    def __init__(self, source: _Source, key: str) -> None:
        self._source, self._key = source, key

    async def poll(self) -> bytes:
        self._source.polls.append((self._key, time.monotonic(), threading.get_ident()))
        return b"x"

    def close(self) -> None:
        return None


class _Extractor(Extractor):
    type_name = "recording-extractor"

    def __init__(self) -> None:
        super().__init__("recording-extractor", None)

    def extract(self, endpoint: Endpoint, body: bytes) -> ExtractResult:
        return ExtractResult(Metrics(running_requests_size=1))


def _layer(n: int, interval: float) -> tuple[DataLayer, _Source]:
    store = EndpointStore()
    for i in range(n):
        store.upsert(metadata(f"e{i}", "10.0.0.1", 8000 + i))
    source = _Source()
    return DataLayer(store, [(source, [_Extractor()])], refresh_interval=interval), source


async def test_scrapes_go_on_while_the_serving_loop_is_blocked() -> None:
    layer, source = _layer(5, 0.05)
    layer.start()
    try:
        await until(lambda: len(source.polls) >= 5)
        assert all(tid != threading.get_ident() for _, _, tid in source.polls)
        before = len(source.polls)
        time.sleep(0.5)  # the serving loop is stuck (a long synchronous step): no await here
        assert len(source.polls) - before >= 5 * 4, "scrapes waited for the serving loop"
    finally:
        await layer.stop()


async def test_endpoint_ticks_are_spread_over_the_interval() -> None:
    interval = 0.4
    layer, source = _layer(100, interval)
    layer.start()
    try:
        await until(lambda: len({k for k, _, _ in source.polls}) == 100)
        first = max(t for _, t, _ in source.polls) - min(t for _, t, _ in source.polls)
        assert first < interval  # every new endpoint is scraped soon (within 50 ms, plus load)
        await until(lambda: len(source.polls) >= 200, timeout=10)
        by_key: dict[str, list[float]] = {}
        for key, t, _ in list(source.polls):
            by_key.setdefault(key, []).append(t)
        ticks = sorted(ts[1] for ts in by_key.values() if len(ts) >= 2)
        assert len(ticks) > 50
        # the second ticks fall at random phases: spread over most of the interval, not in one burst
        assert ticks[-1] - ticks[0] > interval / 2, ticks[-1] - ticks[0]
    finally:
        await layer.stop()
