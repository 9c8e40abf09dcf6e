"""Periodic pool-level Prometheus gauges (means, standard deviations, ready endpoints) of one pool."""

from __future__ import annotations

import math
import time

import structlog

from epp.background import RepeatingTask
from epp.datalayer.scraper import is_stale
from epp.datalayer.store import EndpointStore
from epp.metrics import (
    POOL_AVG_KV,
    POOL_AVG_QUEUE,
    POOL_AVG_RUNNING,
    POOL_PER_ENDPOINT_QUEUE,
    POOL_READY_ENDPOINTS,
    POOL_STD_KV,
    POOL_STD_QUEUE,
    POOL_STD_RUNNING,
)

log = structlog.get_logger("epp.datalayer.pool_gauges")

DEFAULT_INTERVAL = 5.0
DEFAULT_STALENESS = 2.0


def _mean_std(values: list[float] | list[int]) -> tuple[float, float]:
    """Mean and sample standard deviation (divided by max(1, n - 1)), both to two decimals as the
    reference reports them; both 0 for no values."""
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    squares = sum((v - mean) ** 2 for v in values)
    return round(mean, 2), round(math.sqrt(squares / max(1, len(values) - 1)), 2)


class PoolGauges:
    """Sets the pool gauges of one pool; ``start()`` in a running loop, ``stop()``.

    Every ``interval`` seconds: the number of endpoints whose metrics are fresher than ``staleness``,
    the means and standard deviations of their KV-cache usage, waiting queue and running
    requests (0 without any), and each fresh endpoint's waiting queue under its endpoint name; series
    of endpoints gone or stale are removed. The deprecated ``inference_pool_*`` names are rendered
    from these (``epp.metrics``).
    """

    def __init__(
        self,
        store: EndpointStore,
        pool_name: str,
        interval: float = DEFAULT_INTERVAL,
        staleness: float = DEFAULT_STALENESS,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self._store = store
        self.pool_name = pool_name
        self.interval = interval
        self.staleness = staleness
        self._per_pod: set[str] = set()
        self._task = RepeatingTask(
            "pool gauges", self.refresh, lambda: self.interval, log, "refreshing pool gauges failed"
        )

    def refresh(self, now: float | None = None) -> None:
        """Compute and set every gauge once from the store's current endpoints."""
        if now is None:
            now = time.monotonic()
        fresh = [e for e in self._store.endpoints() if not is_stale(e, self.staleness, now)]
        name = self.pool_name
        count = len(fresh)
        POOL_READY_ENDPOINTS.labels(name).set(count)
        for avg, std, values in (
            (POOL_AVG_KV, POOL_STD_KV, [e.metrics.kv_cache_usage_percent for e in fresh]),
            (POOL_AVG_QUEUE, POOL_STD_QUEUE, [e.metrics.waiting_queue_size for e in fresh]),
            (POOL_AVG_RUNNING, POOL_STD_RUNNING, [e.metrics.running_requests_size for e in fresh]),
        ):
            mean, dev = _mean_std(values)
            avg.labels(name).set(mean)
            std.labels(name).set(dev)
        current: set[str] = set()
        for endpoint in fresh:
            pod = endpoint.metadata.name
            current.add(pod)
            POOL_PER_ENDPOINT_QUEUE.labels(name, pod).set(endpoint.metrics.waiting_queue_size)
        for pod in self._per_pod - current:
            POOL_PER_ENDPOINT_QUEUE.remove(name, pod)
        self._per_pod = current

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
