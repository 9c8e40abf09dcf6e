"""Periodic pool-level Prometheus gauges (``inference_pool_*``) computed from the endpoints' metrics."""

from __future__ import annotations

import time

import structlog

from epp.background import RepeatingTask
from epp.datalayer.scraper import is_stale
from epp.datalayer.store import EndpointStore
from epp.metrics import POOL_AVG_KV, POOL_AVG_QUEUE, POOL_AVG_RUNNING, POOL_PER_POD_QUEUE, POOL_READY_PODS

log = structlog.get_logger("epp.datalayer.pool_gauges")

DEFAULT_INTERVAL = 5.0
DEFAULT_STALENESS = 2.0


class PoolGauges:
    """Sets the ``inference_pool_*`` gauges of one pool; ``start()`` in a running loop, ``stop()``.

    Every ``interval`` seconds: the number of endpoints whose metrics are fresher than ``staleness``,
    the means of their KV-cache usage, waiting queue and running requests (0 without any), and each
    fresh endpoint's waiting queue under its endpoint name; series of endpoints gone or stale are
    removed.
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
        POOL_READY_PODS.labels(name=name).set(count)
        divisor = count or 1  # no fresh endpoint: every average is 0
        kv = sum(e.metrics.kv_cache_usage_percent for e in fresh)
        queue = sum(e.metrics.waiting_queue_size for e in fresh)
        running = sum(e.metrics.running_requests_size for e in fresh)
        POOL_AVG_KV.labels(name=name).set(kv / divisor)
        POOL_AVG_QUEUE.labels(name=name).set(queue / divisor)
        POOL_AVG_RUNNING.labels(name=name).set(running / divisor)
        current: set[str] = set()
        for endpoint in fresh:
            pod = endpoint.metadata.name
            current.add(pod)
            queue_size = endpoint.metrics.waiting_queue_size
            POOL_PER_POD_QUEUE.labels(name=name, model_server_pod=pod).set(queue_size)
        for pod in self._per_pod - current:
            try:
                POOL_PER_POD_QUEUE.remove(name, pod)
            except KeyError:
                pass
        self._per_pod = current

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
