"""``dcgm-extractor`` (alpha): an endpoint's GPU utilisation from DCGM exporter metrics.

Reads ``DCGM_FI_DEV_GPU_UTIL`` (percent per GPU), keeps the samples of this endpoint's pod (samples
without a ``pod`` label always count: sidecar exporters), takes the busiest GPU and stores
``max / 100`` as ``Endpoint.attributes[GPU_UTILIZATION_KEY]`` (``GPUUtilization/dcgm-extractor``).
"""

from __future__ import annotations

import math
from typing import Any

from epp.framework import Endpoint, Extractor, Stability, register
from epp.framework.endpoint_attributes import GPU_UTILIZATION_KEY
from epp.plugins.scraping.promtext import Selector

GPU_UTIL_METRIC = "DCGM_FI_DEV_GPU_UTIL"
POD_LABEL = "pod"


@register
class DcgmExtractor(Extractor):
    type_name = "dcgm-extractor"
    stability = Stability.ALPHA

    def __init__(self, name: str, params: Any = None, handle: Any = None) -> None:
        super().__init__(name, params, handle)
        self._selector = Selector.parse(GPU_UTIL_METRIC)

    def extract_attributes(self, endpoint: Endpoint, payload: Any) -> tuple[str, ...]:
        if not isinstance(payload, bytes):
            return (f"expected a metrics page, got {type(payload).__name__}",)
        samples = self._selector.samples(payload, with_labels=True)
        if not samples:
            return (f"metric {GPU_UTIL_METRIC!r} not found in the DCGM response",)
        pod = endpoint.metadata.pod_name or endpoint.metadata.name
        busiest = 0.0
        found = False
        for sample in samples:
            owner = sample.labels.get(POD_LABEL)
            if owner is not None and owner != pod:
                continue
            if not math.isfinite(sample.value):
                return (f"metric {GPU_UTIL_METRIC!r} has a non-finite value {sample.value}",)
            found = True
            if sample.value > busiest:
                busiest = sample.value
        if not found:
            return (f"metric {GPU_UTIL_METRIC!r} present but has no samples for pod {pod!r}",)
        endpoint.attributes[GPU_UTILIZATION_KEY] = busiest / 100.0
        return ()
