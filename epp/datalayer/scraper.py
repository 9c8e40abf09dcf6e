"""The scrape loop of one polled data source: one asyncio task per endpoint.

Each poll feeds the source's extractors: at most one ``MetricsExtractor`` replacing the endpoint's
``Metrics`` snapshot (and keeping its freshness), and any ``AttributeExtractor``s writing
``Endpoint.attributes``. The contracts (``PollingSource``, ``Poller``, ``MetricsExtractor``,
``AttributeExtractor``) live in ``epp.framework.interfaces``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import structlog

from epp.datalayer.freshness import COLLECTOR, FAILURE_REASONS, SCRAPE_FAILURES
from epp.datalayer.store import EndpointStore
from epp.framework.endpoint import SCRAPE_CONNECT_FAILURE, Endpoint
from epp.framework.interfaces import (
    AttributeExtractor,
    DataSource,
    Extractor,
    MetricsExtractor,
    Poller,
    PollError,
    PollingSource,
)
from epp.metrics import DATALAYER_EXTRACT_ERRORS, DATALAYER_POLL_ERRORS

if TYPE_CHECKING:
    from epp.datalayer.scrape_loop import ScrapeLoop

log = structlog.get_logger("epp.datalayer.scraper")

DEFAULT_INTERVAL = 0.05
DEFAULT_STALENESS = 2.0
_FIRST_SCRAPE_SPREAD = 0.05  # a new endpoint's first scrape comes within this (jittered)
# Scrapes may start at one of this many instants per interval, shared by every endpoint of the
# source (each endpoint at a random one): the data layer's thread then wakes for a batch of scrapes
# at a time (make bench-pools: idle CPU at 400 endpoints 8 % -> 6 % of a core). 0 (the default):
# each endpoint at its own random phase. Off because with slots the cross-replica detector test
# (test_cross_replica, the in-flight credit against the scrapes' timing) failed two runs in three.
SCRAPE_SLOTS = 0
MIN_DEFAULT_TIMEOUT = 1.0
DEFAULT_TIMEOUT = max(MIN_DEFAULT_TIMEOUT, DEFAULT_STALENESS - DEFAULT_INTERVAL)


def default_timeout(interval: float, staleness: float) -> float:
    """The scrape timeout when none is set: what is left of the staleness threshold after one
    interval (a scrape answering within it refreshes the metrics before they go stale; a later
    answer is stale anyway), and at least 1 s."""
    return max(MIN_DEFAULT_TIMEOUT, staleness - interval)


def is_stale(endpoint: Endpoint, threshold: float, now: float | None = None) -> bool:
    """True when the endpoint's metrics were never extracted or are older than ``threshold`` s.

    With the scraper's own threshold this is ``not endpoint.metrics.known(now)``.
    """
    updated = endpoint.metrics.update_time
    if updated == 0.0:
        return True
    return (time.monotonic() if now is None else now) - updated > threshold


class MetricsScraper:
    """Polls one source for every store endpoint; ``start()`` in a running loop, ``stop()``.

    One task per endpoint: poll with a timeout, extract, replace the snapshot as a whole (readers never
    see half an update) with ``fresh_until = update_time + staleness``. A tick starts only after the
    previous scrape ended; missed ticks are dropped. Failures are logged on state changes only. A
    source without a metrics extractor (attributes only) never touches ``Endpoint.metrics``.

    With a ``runner`` (``ScrapeLoop``) the tasks run on the data layer's own thread; with
    ``jitter`` each endpoint's first tick is drawn at random within one interval, so a thousand
    endpoints do not fire together. ``skip(endpoint)`` true: the tick passes without a poll (the
    endpoint's load is pushed, or another replica scrapes it); ``rest(endpoint)`` then says how
    long the skip surely holds (pushes still fresh), and the next tick waits at least that long.
    """

    def __init__(
        self,
        store: EndpointStore,
        source: DataSource,
        extractor: Extractor | Sequence[Extractor],
        interval: float = DEFAULT_INTERVAL,
        timeout: float = DEFAULT_TIMEOUT,
        staleness: float = DEFAULT_STALENESS,
        *,
        runner: ScrapeLoop | None = None,
        jitter: bool = False,
        skip: Callable[[Endpoint], bool] | None = None,
    ) -> None:
        if interval <= 0 or timeout <= 0 or staleness <= 0:
            raise ValueError("interval, timeout and staleness must be positive")
        if not isinstance(source, PollingSource):
            raise TypeError(f"data source {source!r} cannot be polled per endpoint (no poller())")
        extractors = [extractor] if isinstance(extractor, Extractor) else list(extractor)
        metrics_extractors = [e for e in extractors if isinstance(e, MetricsExtractor)]
        attribute_extractors = [
            e for e in extractors if isinstance(e, AttributeExtractor) and not isinstance(e, MetricsExtractor)
        ]
        if len(metrics_extractors) > 1:
            raise TypeError(f"data source {source!r}: only one extractor may produce the endpoint metrics")
        for e in extractors:
            if not isinstance(e, MetricsExtractor | AttributeExtractor):
                raise TypeError(f"extractor {e!r} cannot extract metrics (no extract())")
        if not extractors:
            raise TypeError(f"data source {source!r} has no extractor")
        self._store = store
        self._source = cast(PollingSource, source)
        self._extractor = cast(MetricsExtractor, metrics_extractors[0]) if metrics_extractors else None
        self._attribute_extractors = tuple(
            (
                cast(AttributeExtractor, e),
                e.type_name,
                DATALAYER_EXTRACT_ERRORS.labels(source.type_name, e.type_name),
            )
            for e in attribute_extractors
        )
        self.source_name = source.name
        self.interval = interval
        self.timeout = timeout
        self.staleness = staleness
        if interval >= staleness and self._extractor is not None:
            log.warning(
                "the metrics refresh interval is not shorter than the staleness threshold: "
                "endpoint metrics will count as unknown between scrapes",
                source=source.name,
                refresh_metrics_interval=interval,
                metrics_staleness_threshold=staleness,
            )
        self._runner = runner
        self._jitter = jitter
        self.skip = skip
        self.rest: Callable[[Endpoint], float] | None = None
        self.scrapes = 0  # polls issued (a bench and test figure)
        # main-loop side: one handle per endpoint (an asyncio task, or the runner's future)
        self._tasks: dict[Endpoint, asyncio.Task[None] | concurrent.futures.Future[None]] = {}
        self._live: set[asyncio.Task[None]] = set()  # runner side: the running scrape tasks
        self._running = False
        self._subscribed = False
        self._poll_errors = DATALAYER_POLL_ERRORS.labels(source.type_name)
        self._extract_errors = (
            DATALAYER_EXTRACT_ERRORS.labels(source.type_name, metrics_extractors[0].type_name)
            if metrics_extractors
            else _NO_COUNTER
        )

    @property
    def produces_metrics(self) -> bool:
        """True when this source's extractor maintains ``Endpoint.metrics`` (and its freshness)."""
        return self._extractor is not None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start scraping current and future store endpoints (needs a running event loop)."""
        if self._running:
            return
        self._running = True
        if self._extractor is not None:
            COLLECTOR.track(self)
        if not self._subscribed:
            # The store has no unsubscribe: the listeners stay registered and do nothing once
            # the scraper is stopped (a restarted scraper picks the current endpoints up here).
            self._subscribed = True
            self._store.subscribe(on_add=self._on_add, on_remove=self._on_remove)
        else:
            for endpoint in self._store.endpoints():
                self._on_add(endpoint)

    async def stop(self) -> None:
        """Cancel every scrape task and wait for them (their connections are closed)."""
        self._running = False
        COLLECTOR.untrack(self)
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if self._runner is not None:
            if self._runner.running:
                await asyncio.wrap_future(self._runner.submit(self._drain()))
            return
        if tasks:
            await asyncio.gather(*(t for t in tasks if isinstance(t, asyncio.Task)), return_exceptions=True)

    async def _drain(self) -> None:
        """On the runner: cancel and wait for the scrape tasks still there (their pollers close)."""
        live = list(self._live)
        for task in live:
            task.cancel()
        if live:
            await asyncio.gather(*live, return_exceptions=True)

    def is_stale(self, endpoint: Endpoint, threshold: float) -> bool:
        return is_stale(endpoint, threshold)

    def tracked_endpoints(self) -> Sequence[Endpoint]:
        """The endpoints whose metrics state this scraper maintains (the store's)."""
        return self._store.endpoints()

    @property
    def scraped_endpoints(self) -> frozenset[Endpoint]:
        """Endpoints that currently have a scrape task."""
        return frozenset(self._tasks)

    # --- store listeners -------------------------------------------------------------------------

    def _on_add(self, endpoint: Endpoint) -> None:
        if not self._running or endpoint in self._tasks:
            return
        if self._runner is not None:
            self._tasks[endpoint] = self._runner.submit(self._run(endpoint))
            return
        task = asyncio.get_running_loop().create_task(
            self._run(endpoint), name=f"scrape {endpoint.metadata.key}"
        )
        self._tasks[endpoint] = task

    def _on_remove(self, endpoint: Endpoint) -> None:
        task = self._tasks.pop(endpoint, None)
        if task is not None:
            task.cancel()

    # --- per-endpoint loop ---------------------------------------------------------------------------

    async def _run(self, endpoint: Endpoint) -> None:
        loop = asyncio.get_running_loop()
        poller = self._source.poller(endpoint)
        state = _ScrapeState()
        me = asyncio.current_task()
        if me is not None:
            self._live.add(me)
        try:
            next_tick = loop.time()
            if self._jitter:  # the first scrape soon, the phase of the next ones on any slot of a tick
                next_tick = self._slot(next_tick + random.random() * min(self.interval, _FIRST_SCRAPE_SPREAD))
                await asyncio.sleep(next_tick - loop.time())
            phase = self._phase() if self._jitter else 0.0
            while True:
                skip = self.skip
                rest = 0.0
                if skip is None or not skip(endpoint):
                    self.scrapes += 1
                    await self._scrape(endpoint, poller, state)
                elif self.rest is not None:
                    rest = self.rest(endpoint)  # pushed: no tick needed until the pushes may stop
                next_tick += self.interval + phase
                phase = 0.0
                now = loop.time()
                if rest > 0.0 and next_tick < now + rest:
                    next_tick = now + rest
                if next_tick < now:  # the scrape overran: drop missed ticks, never burst
                    next_tick = now + self.interval - (now - next_tick) % self.interval
                await asyncio.sleep(next_tick - now)
        finally:
            poller.close()
            if me is not None:
                self._live.discard(me)

    def _slot(self, t: float) -> float:
        """The first slot instant at or after ``t`` (slots every ``interval / SCRAPE_SLOTS``)."""
        if SCRAPE_SLOTS <= 0:
            return t
        step = self.interval / SCRAPE_SLOTS
        return math.ceil(t / step) * step

    def _phase(self) -> float:
        """A random whole number of slots: where in each tick this endpoint's scrapes start."""
        if SCRAPE_SLOTS <= 0:
            return random.random() * self.interval
        return random.randrange(SCRAPE_SLOTS) * self.interval / SCRAPE_SLOTS

    async def _scrape(self, endpoint: Endpoint, poller: Poller, state: _ScrapeState) -> None:
        mark = endpoint.inflight  # the snapshot shows what was in flight by now, not what follows
        try:
            async with asyncio.timeout(self.timeout):
                body = await poller.poll()
        except Exception as e:  # timeouts, connection errors, bad statuses
            self._poll_errors.inc()
            detail = "timeout" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            self._failed(endpoint, state, _poll_failure(e), detail)
            return
        if self._attribute_extractors:
            self._extract_attributes(endpoint, body, state)
        if self._extractor is None:
            if state.failure:
                state.failure = ""
                log.info(
                    "data source poll recovered", source=self.source_name, endpoint=endpoint.metadata.key
                )
            return
        try:
            result = self._extractor.extract(endpoint, body)
        except Exception as e:
            self._extract_errors.inc()
            self._failed(endpoint, state, "extractor_error", f"{type(e).__name__}: {e}")
            return
        if result.errors:
            self._extract_errors.inc()
        if result.errors != state.errors:
            state.errors = result.errors
            if result.errors:
                log.warning("metrics extraction errors", endpoint=endpoint.metadata.key, errors=result.errors)
        metrics = result.metrics
        if metrics is None:
            self._failed(endpoint, state, "no_metrics", "no metric could be extracted from the response")
            return
        updated = metrics.update_time if metrics.update_time > 0.0 else time.monotonic()
        endpoint.metrics = dataclasses.replace(
            metrics,
            update_time=updated,
            fresh_until=updated + self.staleness,
            failure="",
            inflight_at_scrape=mark,
            peak_running=max(endpoint.metrics.peak_running, metrics.running_requests_size),
        )
        if state.failure:
            state.failure = ""
            log.info("metrics scrape recovered", endpoint=endpoint.metadata.key)

    def _extract_attributes(self, endpoint: Endpoint, payload: object, state: _ScrapeState) -> None:
        """Run the attribute extractors; errors are counted, and logged when they change."""
        for i, (extractor, type_name, errors_counter) in enumerate(self._attribute_extractors):
            try:
                errors = extractor.extract_attributes(endpoint, payload)
            except Exception as e:
                errors = (f"{type(e).__name__}: {e}",)
            if errors:
                errors_counter.inc()
            previous = state.attribute_errors.get(i, ())
            if errors != previous:
                state.attribute_errors[i] = errors
                if errors:
                    log.warning(
                        "attribute extraction errors",
                        source=self.source_name,
                        extractor=type_name,
                        endpoint=endpoint.metadata.key,
                        errors=errors,
                    )

    def _failed(self, endpoint: Endpoint, state: _ScrapeState, reason: str, detail: str) -> None:
        """Count a failed attempt and record its reason on the snapshot (on changes only)."""
        if self._extractor is None:  # attributes only: the metrics' freshness is not this source's
            if state.failure != reason:
                state.failure = reason
                log.warning(
                    "data source poll failing",
                    source=self.source_name,
                    endpoint=endpoint.metadata.key,
                    reason=reason,
                    error=detail,
                )
            return
        SCRAPE_FAILURES.labels(reason).inc()
        metrics = endpoint.metrics
        if metrics.failure != reason:
            endpoint.metrics = dataclasses.replace(metrics, failure=reason)
        if state.failure != reason:
            state.failure = reason
            log.warning(
                "metrics scrape failing",
                endpoint=endpoint.metadata.key,
                reason=reason,
                error=detail,
                metrics_known_for_s=round(max(0.0, metrics.fresh_until - time.monotonic()), 3),
            )


def _poll_failure(e: Exception) -> str:
    """The bounded failure reason of a poll exception."""
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, PollError):
        return e.reason if e.reason in FAILURE_REASONS else "poll_error"
    if isinstance(e, OSError | EOFError):
        return SCRAPE_CONNECT_FAILURE
    return "poll_error"


class _NoCounter:
    def inc(self) -> None:
        return None


_NO_COUNTER = _NoCounter()


@dataclass(slots=True)
class _ScrapeState:
    """Per-endpoint state used to log transitions only."""

    failure: str = ""
    errors: tuple[str, ...] = ()
    attribute_errors: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
