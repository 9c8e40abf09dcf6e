"""The EPP's own Prometheus metrics, with the reference's names, types and labels.

Module-level objects; per-request ones use ``epp.promlite``. Request-derived labels go through
``epp.labels``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric

from epp import labels, promlite

if TYPE_CHECKING:
    from epp.framework import Endpoint

M = ("model_name", "target_model_name")
_MODELS = {"model_name": labels.MODEL_NAMES, "target_model_name": labels.MODEL_NAMES}

LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
SCHEDULER_BUCKETS = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip
PLUGIN_BUCKETS = (
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
)  # fmt: skip
SIZE_BUCKETS = (*(float(64 * 4**i) for i in range(13)), float(1 << 30))

registry: CollectorRegistry = REGISTRY

REQUEST_TOTAL = promlite.Counter(
    "inference_objective_request_total",
    "[ALPHA] Counter of inference objective requests broken out for each model and target model.",
    [*M, "priority"],
    bounded=_MODELS,
)
REQUEST_ERROR_TOTAL = promlite.Counter(
    "inference_objective_request_error_total",
    "[ALPHA] Counter of inference objective requests errors broken out for each model and target model.",
    [*M, "error_code"],
    bounded=_MODELS,
)
REQUEST_DURATION = promlite.Histogram(
    "inference_objective_request_duration_seconds",
    "[ALPHA] Inference objective response latency distribution in seconds for each model and target model.",
    M,
    buckets=LATENCY_BUCKETS,
    bounded=_MODELS,
)
REQUEST_SIZES = promlite.Histogram(
    "inference_objective_request_sizes",
    "[ALPHA] Inference objective requests size distribution in bytes for each model and target model.",
    M,
    buckets=SIZE_BUCKETS,
    bounded=_MODELS,
)
RUNNING_REQUESTS = promlite.Gauge(
    "inference_objective_running_requests",
    "[ALPHA] Inference objective number of running requests in each model.",
    ["model_name"],
    bounded={"model_name": labels.MODEL_NAMES},
)
POOL_AVG_KV = Gauge(
    "inference_pool_average_kv_cache_utilization",
    "[ALPHA] The average kv cache utilization for an inference server pool.",
    ["name"],
)
POOL_AVG_QUEUE = Gauge(
    "inference_pool_average_queue_size",
    "[ALPHA] The average number of requests pending in the model server queue.",
    ["name"],
)
POOL_AVG_RUNNING = Gauge(
    "inference_pool_average_running_requests",
    "[ALPHA] The average number of running requests in the model server.",
    ["name"],
)
POOL_READY_PODS = Gauge(
    "inference_pool_ready_pods",
    "[ALPHA] The number of ready pods in the inference server pool.",
    ["name"],
)
POOL_PER_POD_QUEUE = Gauge(
    "inference_pool_per_pod_queue_size",
    "[ALPHA] The total number of requests pending in the model server queue for each underlying pod.",
    ["name", "model_server_pod"],
)
SCHEDULER_E2E = promlite.Histogram(
    "inference_extension_scheduler_e2e_duration_seconds",
    "[ALPHA] End-to-end scheduling latency distribution in seconds.",
    buckets=SCHEDULER_BUCKETS,
)

SCHEDULER_ATTEMPTS = promlite.Counter(
    "inference_extension_scheduler_attempts_total",
    "[ALPHA] Total number of scheduling attempts.",
    ["status", "target_model_name", "pod_name", "namespace", "port"],
    bounded={"target_model_name": labels.MODEL_NAMES},
)
PLUGIN_DURATION = promlite.Histogram(
    "inference_extension_plugin_duration_seconds",
    "[ALPHA] Plugin latency distribution in seconds for each extension point, plugin type and plugin name.",
    ["extension_point", "plugin_type", "plugin_name"],
    buckets=PLUGIN_BUCKETS,
)
MODEL_REWRITE_DECISIONS = promlite.Counter(
    "inference_extension_model_rewrite_decisions_total",
    "[ALPHA] Total number of inference model rewrite decisions.",
    ["model_rewrite_name", "model_name", "target_model"],
    bounded={"model_name": labels.MODEL_NAMES, "target_model": labels.MODEL_NAMES},
)
INFO = Gauge(
    "inference_extension_info",
    "[ALPHA] General information of the current build of Inference Extension.",
    ["commit", "build_ref"],
)
DATALAYER_POLL_ERRORS = Counter(
    "llm_d_inference_scheduler_datalayer_poll_errors_total",
    "[ALPHA] Total number of data layer poll errors.",
    ["source_type"],
)
DATALAYER_EXTRACT_ERRORS = Counter(
    "llm_d_inference_scheduler_datalayer_extract_errors_total",
    "[ALPHA] Total number of data layer extract errors.",
    ["source_type", "extractor_type"],
)

EXTPROC_STREAMS_INFLIGHT = promlite.Gauge(
    "llm_d_epp_extproc_streams_inflight", "[ALPHA] Number of ext_proc gRPC streams currently open."
)
EXTPROC_STREAMS_REJECTED = promlite.Counter(
    "llm_d_epp_extproc_streams_rejected_total",
    "[ALPHA] ext_proc streams the EPP ended before serving their request, by reason "
    "(idle_timeout, body_budget, protocol_error).",
    ["reason"],
)
EXTPROC_BUFFERED_BYTES = promlite.Gauge(
    "llm_d_epp_extproc_buffered_request_body_bytes",
    "[ALPHA] Request-body bytes held by ext_proc streams waiting for the rest of their body "
    "(bounded by --max-buffered-request-body-bytes).",
)
STREAM_REJECT_REASONS = ("idle_timeout", "body_budget", "protocol_error")
EXTPROC_STREAMS_INFLIGHT.labels()  # rendered as 0 before the first stream
EXTPROC_BUFFERED_BYTES.labels()
for _reason in STREAM_REJECT_REASONS:
    EXTPROC_STREAMS_REJECTED.labels(_reason)

promlite.register(
    EXTPROC_STREAMS_INFLIGHT,
    EXTPROC_STREAMS_REJECTED,
    EXTPROC_BUFFERED_BYTES,
    REQUEST_TOTAL,
    REQUEST_ERROR_TOTAL,
    REQUEST_DURATION,
    REQUEST_SIZES,
    RUNNING_REQUESTS,
    SCHEDULER_E2E,
    SCHEDULER_ATTEMPTS,
    PLUGIN_DURATION,
    MODEL_REWRITE_DECISIONS,
)

_plugin_children: dict[tuple[str, int], promlite.HistogramChild] = {}


def observe_plugin(extension_point: str, plugin: object, seconds: float) -> None:
    """The scheduler's plugin timer: ``inference_extension_plugin_duration_seconds``."""
    key = (extension_point, id(plugin))  # plugins live as long as the process
    c = _plugin_children.get(key)
    if c is None:
        labels = (extension_point, getattr(plugin, "type_name", ""), getattr(plugin, "name", ""))
        c = _plugin_children[key] = PLUGIN_DURATION.labels(*labels)
    c.observe(seconds)


class _EndpointInflight:
    """``llm_d_epp_endpoint_inflight_requests``: each endpoint's in-flight count, read at scrape time."""

    name = "llm_d_epp_endpoint_inflight_requests"

    def __init__(self) -> None:
        self.endpoints: Callable[[], Iterable[Endpoint]] | None = None  # set by the server

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(
            self.name,
            "[ALPHA] Requests this EPP routed to each endpoint whose ext_proc stream has not ended.",
            labels=["name", "namespace", "address"],
        )
        source = self.endpoints
        for e in source() if source is not None else ():
            m = e.metadata
            fam.add_metric([m.name, m.namespace, m.hostport], e.inflight)
        yield fam

    def describe(self) -> list[Metric]:
        return []


ENDPOINT_INFLIGHT = _EndpointInflight()
registry.register(ENDPOINT_INFLIGHT)
