"""Prometheus view of endpoint-metrics freshness: endpoints by state, scrape failures by reason."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily, Metric

from epp import promlite
from epp.framework.endpoint import Endpoint, MetricsState

FAILURE_REASONS = (
    "timeout",  # the poll did not finish within the scrape timeout (a hung /metrics)
    "connect",  # connection refused, reset or closed before a response
    "http_status",  # a status other than 200
    "malformed_response",  # an unparsable or oversized HTTP response
    "poll_error",  # any other poll failure
    "no_metrics",  # a 200 response from which no metric could be extracted (garbage, wrong engine)
    "extractor_error",  # the extractor raised
)

SCRAPE_FAILURES = promlite.Counter(
    "llm_d_epp_datalayer_scrape_failures_total",
    "Failed endpoint metrics scrapes by reason.",
    ["reason"],
)
promlite.register(SCRAPE_FAILURES)
for _reason in FAILURE_REASONS:
    SCRAPE_FAILURES.labels(_reason)


class _Tracked(Protocol):
    """What the collector reads of a scraper."""

    @property
    def staleness(self) -> float: ...

    def tracked_endpoints(self) -> Sequence[Endpoint]: ...


class FreshnessCollector:
    """Computes the state gauge and the threshold gauge over the tracked scrapers when scraped."""

    def __init__(self) -> None:
        self._tracked: weakref.WeakSet[_Tracked] = weakref.WeakSet()

    def track(self, scraper: _Tracked) -> None:
        """Count ``scraper``'s endpoints for as long as it lives."""
        self._tracked.add(scraper)

    def untrack(self, scraper: _Tracked) -> None:
        self._tracked.discard(scraper)

    def counts(self, now: float | None = None) -> dict[MetricsState, int]:
        now = time.monotonic() if now is None else now
        counts = dict.fromkeys(MetricsState, 0)
        seen: set[int] = set()
        for scraper in list(self._tracked):
            for endpoint in scraper.tracked_endpoints():
                if id(endpoint) not in seen:  # two scrapers over one store count it once
                    seen.add(id(endpoint))
                    counts[endpoint.metrics.state(now)] += 1
        return counts

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily(
            "llm_d_epp_datalayer_endpoints",
            "Endpoints by the state of their scraped metrics (only fresh metrics are used for scoring).",
            labels=["state"],
        )
        for state, count in self.counts().items():
            states.add_metric([state.value], count)
        yield states
        thresholds = [s.staleness for s in list(self._tracked)]
        yield GaugeMetricFamily(
            "llm_d_epp_datalayer_metrics_staleness_threshold_seconds",
            "Age after which scraped endpoint metrics count as unknown (--metrics-staleness-threshold).",
            value=max(thresholds, default=0.0),
        )

    def describe(self) -> list[Metric]:
        return []


COLLECTOR = FreshnessCollector()
REGISTRY.register(COLLECTOR)
