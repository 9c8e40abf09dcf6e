"""How old the metrics were that a decision read: ``llm_d_epp_decision_metrics_age_seconds``.

Per profile run, the age of the picked endpoint's ``Metrics`` (now minus the scrape's or push's
``update_time``) when the profile picked it; endpoints never scraped are not observed. With
scraping every interval ``T`` the age is at most about ``T`` plus one scrape; more means scrapes
fall behind.
"""

from __future__ import annotations

import time

from epp import promlite
from epp.framework.endpoint import Endpoint

AGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
METRICS_AGE = promlite.Histogram(
    "llm_d_epp_decision_metrics_age_seconds",
    "[ALPHA] Age of the picked endpoint's metrics when a scheduling profile picked it (epp).",
    ("profile",),
    buckets=AGE_BUCKETS,
)
promlite.register(METRICS_AGE)


class MetricsAge:
    """One profile's bound series."""

    __slots__ = ("_series",)

    def __init__(self, profile: str) -> None:
        self._series = METRICS_AGE.labels(profile)

    def record(self, picked: Endpoint) -> None:
        updated = picked.metrics.update_time
        if updated > 0.0:
            self._series.observe(max(0.0, time.monotonic() - updated))
