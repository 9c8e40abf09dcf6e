"""Keys and value types of ``Endpoint.attributes``: endpoint-level data written by the data layer.

A key is ``"<data type>/<producer>"``, as the reference spells its data keys, so configuration
naming an ``attribute`` and a ``producer`` (e.g. ``GPUUtilization`` from ``dcgm-extractor``)
addresses the same entry. Scalar attributes are plain ``float`` values.
"""

from __future__ import annotations

from dataclasses import dataclass

CORE_METRICS_EXTRACTOR = "core-metrics-extractor"
DCGM_EXTRACTOR = "dcgm-extractor"
MODELS_EXTRACTOR = "models-data-extractor"


def data_key(data_type: str, producer: str) -> str:
    """The attribute key of ``data_type`` published by ``producer``."""
    return f"{data_type}/{producer}"


def scalar_metric_key(attribute_key: str) -> str:
    """Where ``core-metrics-extractor`` stores a ``customMetrics`` entry's value."""
    return data_key(attribute_key, CORE_METRICS_EXTRACTOR)


GPU_UTILIZATION_KEY = data_key("GPUUtilization", DCGM_EXTRACTOR)  # float in [0, 1]
MODELS_KEY = data_key("/v1/models", MODELS_EXTRACTOR)  # tuple[ModelData, ...]


@dataclass(slots=True, frozen=True)
class ModelData:
    """One entry of an endpoint's ``/v1/models`` answer (``parent`` is set for LoRA adapters)."""

    id: str
    object: str = ""
    created: int = 0
    owned_by: str = ""
    parent: str = ""


# Producer-agnostic pool aggregates of a peer cluster (``multicluster-metrics-extractor``); floats.
MULTICLUSTER_KV_CACHE_UTILIZATION_KEY = "llm-d.ai/multicluster-kv-cache-utilization"
MULTICLUSTER_QUEUE_SIZE_KEY = "llm-d.ai/multicluster-queue-size"
