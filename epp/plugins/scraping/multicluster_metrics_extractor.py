"""``multicluster-metrics-extractor`` (alpha): a peer cluster's pool aggregates as endpoint attributes.

Reads the cluster EPP's ``llm_d_epp_average_kv_cache_utilization`` and
``llm_d_epp_average_queue_size`` (selectors: ``kvCacheUtilizationMetric``, ``queueSizeMetric``,
``name{label="value"}``) into the attributes the multicluster scorers read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from epp.framework import ConfigError, Endpoint, Extractor, Stability, register
from epp.framework.endpoint_attributes import (
    MULTICLUSTER_KV_CACHE_UTILIZATION_KEY,
    MULTICLUSTER_QUEUE_SIZE_KEY,
)
from epp.framework.interfaces import Handle
from epp.plugins.scraping.promtext import Selector

__all__ = ["MultiClusterMetricsExtractor", "MultiClusterMetricsExtractorParams"]

DEFAULT_KV_METRIC = "llm_d_epp_average_kv_cache_utilization"
DEFAULT_QUEUE_METRIC = "llm_d_epp_average_queue_size"


@dataclass(slots=True, frozen=True)
class MultiClusterMetricsExtractorParams:
    kv_cache_utilization_metric: str = DEFAULT_KV_METRIC  # "" is accepted as the same
    queue_size_metric: str = DEFAULT_QUEUE_METRIC  # "" is accepted as the same

    def effective(self) -> MultiClusterMetricsExtractorParams:
        """With the metrics read (empty means the default)."""
        return MultiClusterMetricsExtractorParams(
            self.kv_cache_utilization_metric or DEFAULT_KV_METRIC,
            self.queue_size_metric or DEFAULT_QUEUE_METRIC,
        )


def _selector(spec: str, field_name: str) -> Selector:
    try:
        return Selector.parse(spec)
    except ValueError as e:
        raise ConfigError(field_name, str(e)) from None


@register
class MultiClusterMetricsExtractor(Extractor):
    type_name = "multicluster-metrics-extractor"
    stability = Stability.ALPHA
    Params = MultiClusterMetricsExtractorParams

    def __init__(
        self,
        name: str,
        params: MultiClusterMetricsExtractorParams | None = None,
        handle: Handle | None = None,
    ) -> None:
        params = params if params is not None else MultiClusterMetricsExtractorParams()
        super().__init__(name, params, handle)
        self._metrics = (
            (
                _selector(
                    params.kv_cache_utilization_metric or DEFAULT_KV_METRIC, "kvCacheUtilizationMetric"
                ),
                MULTICLUSTER_KV_CACHE_UTILIZATION_KEY,
            ),
            (
                _selector(params.queue_size_metric or DEFAULT_QUEUE_METRIC, "queueSizeMetric"),
                MULTICLUSTER_QUEUE_SIZE_KEY,
            ),
        )

    def extract_attributes(self, endpoint: Endpoint, payload: Any) -> tuple[str, ...]:
        if not isinstance(payload, bytes):
            return (f"expected a metrics page, got {type(payload).__name__}",)
        errors: list[str] = []
        for selector, key in self._metrics:
            value = selector.value(payload)
            if value is None or not math.isfinite(value):
                errors.append(f"{key}: metric {selector} not found or not finite")
                continue
            endpoint.attributes[key] = value
        return tuple(errors)
