"""The data layer at run time: one scraper per polled source, event feeds for notification sources.

Polled sources tick on a common base, ``--refresh-metrics-interval``, lowered to the smallest
source ``interval`` (never below 50 ms); a source's own ``interval`` is rounded to the nearest
multiple of that base (at least one tick), and a source without one polls every base tick.
Scrapes run on the data layer's own thread (``ScrapeLoop``), each endpoint's ticks jittered.
Push sources (``zmq-metrics-data-source``) run on a thread of their own (``PushedLoad``); the
metrics scraper skips an endpoint while its pushes are fresh.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from epp.datalayer.notifications import EndpointEvents
from epp.datalayer.pushed import PushedLoad
from epp.datalayer.scrape_loop import ScrapeLoop
from epp.datalayer.scraper import DEFAULT_STALENESS, MetricsScraper, default_timeout
from epp.datalayer.shared_scrape import SharedScrape
from epp.datalayer.store import EndpointStore
from epp.framework.cross_replica import SharedValue
from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import (
    AttributeExtractor,
    DataSource,
    EndpointSource,
    Extractor,
    LoadExtractor,
    MetricsExtractor,
    NotificationSource,
    PollingSource,
    PushSource,
)

log = structlog.get_logger("epp.datalayer.runtime")

MIN_BASE_TICK = 0.05


def effective_intervals(base: float, requested: Sequence[float | None]) -> tuple[float, list[float]]:
    """The base tick and each polled source's period (``None`` or 0 = every base tick)."""
    floor = min(base, MIN_BASE_TICK)
    tick = base
    for interval in requested:
        if interval and interval < tick:
            tick = interval
    tick = max(tick, floor)
    periods: list[float] = []
    for interval in requested:
        if not interval:
            periods.append(tick)
            continue
        ticks = max(1, math.floor(interval / tick + 0.5))
        periods.append(ticks * tick)
    return tick, periods


class DataLayer:
    """Starts and stops what the configured ``dataLayer.sources`` need; ``start()`` in a running loop."""

    def __init__(
        self,
        store: EndpointStore,
        sources: Sequence[tuple[DataSource, Sequence[Extractor]]],
        refresh_interval: float,
        staleness: float = DEFAULT_STALENESS,
        timeout: float = 0.0,
        *,
        own_thread: bool = True,
        runner: ScrapeLoop | None = None,
    ) -> None:
        """``timeout``: of one scrape (0: ``default_timeout`` of each source's period). ``runner``: a
        data-layer thread shared with other pools' data layers (not stopped here)."""
        self._owns_runner = runner is None
        if runner is None and own_thread:
            runner = ScrapeLoop()
        self.runner: ScrapeLoop | None = runner
        self.scrapers: list[MetricsScraper] = []
        self.endpoint_events: list[EndpointEvents] = []
        self.notification_sources: list[tuple[DataSource, list[Extractor]]] = []
        self._watches: list[Any] = []
        polled: list[tuple[DataSource, list[Extractor]]] = []
        for source, exts in sources:
            if not isinstance(source, PollingSource):
                continue
            usable: list[Extractor] = [
                e for e in exts if isinstance(e, MetricsExtractor | AttributeExtractor)
            ]
            for e in exts:
                if e not in usable:
                    log.warning(
                        "extractor cannot read a polled source; skipped", source=source.name, extractor=e.name
                    )
            if usable:
                polled.append((source, usable))
        _, periods = effective_intervals(refresh_interval, [s.interval for s, _ in polled])
        for (source, extractors), period in zip(polled, periods, strict=True):
            if source.interval and abs(period - source.interval) > 1e-9:
                log.info(
                    "source interval rounded to nearest base-tick multiple",
                    source=source.name,
                    requested_s=source.interval,
                    effective_s=period,
                )
            self.scrapers.append(
                MetricsScraper(
                    store,
                    source,
                    extractors,
                    interval=period,
                    staleness=staleness,
                    timeout=timeout or default_timeout(period, staleness),
                    runner=self.runner,
                    jitter=True,
                )
            )
        self._store = store
        self._staleness = staleness
        self.shared: SharedScrape | None = None
        self.pushed: list[PushedLoad] = [
            PushedLoad(store, source, e, staleness)
            for source, exts in sources
            if isinstance(source, PushSource)
            for e in exts
            if isinstance(e, LoadExtractor)
        ]
        scraper = self.metrics_scraper
        if scraper is not None:
            scraper.skip = self._skip
            if self.pushed:
                scraper.rest = self._rest
        for source, exts in sources:
            if isinstance(source, EndpointSource):
                self.endpoint_events.append(EndpointEvents(store, source, exts))
            elif isinstance(source, NotificationSource):
                self.notification_sources.append((source, list(exts)))

    def _skip(self, endpoint: Endpoint) -> bool:
        """The metrics scrape skips an endpoint whose load is pushed, or that another replica scrapes."""
        shared = self.shared
        return any(p.pushing(endpoint) for p in self.pushed) or (shared is not None and shared.skip(endpoint))

    def _rest(self, endpoint: Endpoint) -> float:
        """How long the endpoint's pushes surely stay fresh (0: not pushed)."""
        return max((p.rest(endpoint) for p in self.pushed), default=0.0)

    def share_scrapes(
        self, replica_id: str, peers: Callable[[], frozenset[str]], sync_interval: float
    ) -> list[SharedValue]:
        """With a cross-replica syncer: scrape only the endpoints this replica owns (rendezvous
        hashing over the live replicas) and share the snapshots; the spec to sync, if any."""
        scraper = self.metrics_scraper
        if scraper is None:
            return []
        grace = max(0.25, 3 * sync_interval + 2 * scraper.interval)
        self.shared = SharedScrape(self._store, replica_id, peers, self._staleness, grace)
        return [self.shared.spec()]

    @property
    def metrics_scraper(self) -> MetricsScraper | None:
        """The scraper maintaining ``Endpoint.metrics`` (the first polled source with such an extractor)."""
        return next((s for s in self.scrapers if s.produces_metrics), None)

    def start(self) -> None:
        for events in self.endpoint_events:
            events.start()
        for pushed in self.pushed:
            pushed.start()
        for scraper in self.scrapers:
            scraper.start()

    def start_watches(self, api: Any, namespace: str) -> None:
        """Kubernetes mode: watch the kinds of the notification sources."""
        from epp.k8s.notification_watch import NotificationWatch  # only with a cluster

        for source, extractors in self.notification_sources:
            watch = NotificationWatch(api, namespace, source, extractors)
            watch.start()
            self._watches.append(watch)

    def warn_without_cluster(self) -> None:
        for source, _ in self.notification_sources:
            log.warning(
                "k8s notification source inactive: it needs Kubernetes mode "
                "(--pool-name or --endpoint-selector)",
                source=source.name,
            )

    async def stop(self) -> None:
        for watch in self._watches:
            await watch.stop()
        self._watches.clear()
        for scraper in self.scrapers:
            await scraper.stop()
        if self.runner is not None and self._owns_runner:
            await self.runner.stop()
        for pushed in self.pushed:
            await asyncio.to_thread(pushed.stop)
        for events in self.endpoint_events:
            await events.stop()
