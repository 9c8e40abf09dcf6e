"""The shared test builders stay in step with the types they build."""

from __future__ import annotations

import dataclasses
import time

from epp.framework import EndpointMetadata, Metrics, MetricsState
from tests.unit.factories import MetadataFields, MetricFields, endpoint, known_metrics


def test_metric_fields_name_every_scraped_value() -> None:
    scraped = {f.name for f in dataclasses.fields(Metrics)} - {"fresh_until"}
    assert set(MetricFields.__annotations__) == scraped


def test_metadata_fields_are_endpoint_metadata_members() -> None:
    assert set(MetadataFields.__annotations__) <= {f.name for f in dataclasses.fields(EndpointMetadata)}


def test_known_metrics_are_fresh_and_a_bare_endpoint_was_never_scraped() -> None:
    now = time.monotonic()
    m = known_metrics(Metrics(waiting_queue_size=3), kv_cache_usage_percent=0.5)
    assert (m.waiting_queue_size, m.kv_cache_usage_percent, m.state(now)) == (3, 0.5, MetricsState.FRESH)
    assert known_metrics(fresh_until=now - 1.0, update_time=1.0).state(now) is MetricsState.STALE
    assert endpoint().metrics.state(now) is MetricsState.NEVER
