"""The EPP's own Prometheus metrics, with the reference's names, types, labels and buckets.

Recorded under the current ``llm_d_epp_*`` names; the deprecated names the reference still emits
(``inference_objective_*``, ``inference_pool_*``, ``inference_extension_*``,
``llm_d_inference_scheduler_*``) are rendered from those at scrape time. Request-derived labels go
through ``epp.labels``; a request's label values are bound once (``request_key``), its pool's once per
pool (``pool_label``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from epp import labels, promlite
from epp.framework.errors import ErrorCode

if TYPE_CHECKING:
    from epp.framework import Endpoint

M = ("model_name", "target_model_name")
REQUEST_LABELS = (*M, "fairness_id", "priority", "inference_pool")
"""The label set of the request and latency metrics, in this order (``request_key``).
``inference_pool`` is epp's: the deprecated twins leave it out (summed), as the reference has none."""
_MODELS = {"model_name": labels.MODEL_NAMES, "target_model_name": labels.MODEL_NAMES}
_REQUEST_BOUNDS = {**_MODELS, "fairness_id": labels.FAIRNESS_IDS, "inference_pool": labels.INFERENCE_POOLS}

LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
# The reference's scheduler and plugin boundaries (0.0001 .. 0.1) plus finer/longer ones: Python
# plugins take tens of microseconds.
SCHEDULER_BUCKETS = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip
PLUGIN_BUCKETS = (
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
)  # fmt: skip
SIZE_BUCKETS = tuple(float(1 << i) for i in range(6, 31))  # 64 B .. 1 GiB
RESPONSE_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
INPUT_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144,
    524288, 1048576,
)  # fmt: skip
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
TTFT_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
    45, 60, 120,
)  # fmt: skip
TPOT_BUCKETS = (
    0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6,
    0.8, 1, 2,
)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2)
REQUEST_PROCESSING_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
)  # fmt: skip
RESPONSE_PROCESSING_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
)  # fmt: skip
STREAM_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)

registry: CollectorRegistry = REGISTRY


def _deprecated(current: str, text: str) -> str:
    return f"[ALPHA] [Deprecated: Use {current}] {text}"


def _request_histogram(
    name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()
) -> promlite.Histogram:
    return promlite.Histogram(name, doc, [*REQUEST_LABELS, *extra], buckets=buckets, bounded=_REQUEST_BOUNDS)


# --- request and latency: llm_d_epp_* recorded, the deprecated inference_objective_* rendered from them
REQUEST_TOTAL = promlite.Counter(
    "llm_d_epp_request_total",
    "[ALPHA] Total number of processed requests.",
    REQUEST_LABELS,
    bounded=_REQUEST_BOUNDS,
)
REQUEST_ERROR_TOTAL = promlite.Counter(
    "llm_d_epp_request_error_total",
    "[ALPHA] Total number of request errors.",
    [*REQUEST_LABELS, "error_code"],
    bounded=_REQUEST_BOUNDS,
)
REQUEST_DURATION = _request_histogram(
    "llm_d_epp_request_duration_seconds",
    "[ALPHA] End-to-end request latency distribution in seconds.",
    LATENCY_BUCKETS,
)
REQUEST_SIZES = _request_histogram(
    "llm_d_epp_request_size_bytes", "[ALPHA] Incoming request body size distribution in bytes.", SIZE_BUCKETS
)
RESPONSE_SIZES = _request_histogram(
    "llm_d_epp_response_size_bytes",
    "[ALPHA] Outgoing response body size distribution in bytes.",
    RESPONSE_SIZE_BUCKETS,
)
INPUT_TOKENS = _request_histogram(
    "llm_d_epp_request_input_tokens",
    "[ALPHA] Input token count distribution per request.",
    INPUT_TOKEN_BUCKETS,
)
OUTPUT_TOKENS = _request_histogram(
    "llm_d_epp_request_output_tokens",
    "[ALPHA] Output token count distribution per request.",
    OUTPUT_TOKEN_BUCKETS,
)
CACHED_TOKENS = _request_histogram(
    "llm_d_epp_request_cached_tokens",
    "[ALPHA] Distribution of prompt tokens read from cache per request, as reported by the model server "
    "in the response.",
    INPUT_TOKEN_BUCKETS,
)
RUNNING_REQUESTS = promlite.Gauge(
    "llm_d_epp_request_running",
    "[ALPHA] Current number of active running requests.",
    REQUEST_LABELS,
    bounded=_REQUEST_BOUNDS,
)
NTPOT = _request_histogram(
    "llm_d_epp_request_ntpot_seconds",
    "[ALPHA] Normalized time per output token in seconds (end-to-end latency divided by output token count).",
    NTPOT_BUCKETS,
)
TTFT = _request_histogram(
    "llm_d_epp_request_ttft_seconds",
    "[ALPHA] Time to first token in seconds, measured from request received to first response byte. "
    "For non-streaming requests, this equals total request duration.",
    TTFT_BUCKETS,
    ("streaming",),
)
TPOT = _request_histogram(
    "llm_d_epp_request_streaming_tpot_seconds",
    "[ALPHA] Average time per output token in seconds for streaming requests, computed as "
    "(e2e - TTFT) / (output_tokens - 1).",
    TPOT_BUCKETS,
)
ITL = _request_histogram(
    "llm_d_epp_request_streaming_itl_seconds",
    "[ALPHA] Inter-token latency in seconds for streaming requests, measured as the time between "
    "consecutive response body chunks.",
    ITL_BUCKETS,
)
# The histograms fed by the token counts the model server reports in the response body (its usage):
# a streamed OpenAI completion carries them only when the client asks (stream_options.include_usage).
FROM_USAGE = (INPUT_TOKENS, OUTPUT_TOKENS, CACHED_TOKENS, NTPOT, TPOT)
REQUEST_PROCESSING = promlite.Histogram(
    "llm_d_epp_request_processing_duration_seconds",
    "[ALPHA] EPP request processing latency distribution in seconds, from request receipt until the "
    "request body has been handled, including admission control.",
    buckets=REQUEST_PROCESSING_BUCKETS,
)
RESPONSE_PROCESSING = promlite.Histogram(
    "llm_d_epp_response_processing_duration_seconds",
    "[ALPHA] EPP response processing latency distribution in seconds: the sum of per-chunk handler time "
    "for a streamed response, or the interval from response headers to completion for a non-streaming "
    "response.",
    buckets=RESPONSE_PROCESSING_BUCKETS,
)

# --- pool (set every --refresh-prometheus-metrics-interval)
POOL_AVG_KV = promlite.Gauge(
    "llm_d_epp_average_kv_cache_utilization",
    "[ALPHA] The average kv cache utilization for an inference server pool.",
    ["name"],
)
POOL_AVG_QUEUE = promlite.Gauge(
    "llm_d_epp_average_queue_size",
    "[ALPHA] The average number of requests pending in the model server queue.",
    ["name"],
)
POOL_AVG_RUNNING = promlite.Gauge(
    "llm_d_epp_average_running_requests",
    "[ALPHA] The average number of running requests across model servers in the pool.",
    ["name"],
)
POOL_STD_KV = promlite.Gauge(
    "llm_d_epp_std_dev_kv_cache_utilization",
    "[ALPHA] The standard deviation kv cache utilization for an inference server pool.",
    ["name"],
)
POOL_STD_QUEUE = promlite.Gauge(
    "llm_d_epp_std_dev_queue_size",
    "[ALPHA] The standard deviation number of requests pending in the model server queue.",
    ["name"],
)
POOL_STD_RUNNING = promlite.Gauge(
    "llm_d_epp_std_dev_running_requests",
    "[ALPHA] The standard deviation number of running requests across model servers in the pool.",
    ["name"],
)
POOL_READY_ENDPOINTS = promlite.Gauge(
    "llm_d_epp_ready_endpoints",
    "[ALPHA] The number of ready endpoints in the inference server pool.",
    ["name"],
)
POOL_PER_ENDPOINT_QUEUE = promlite.Gauge(
    "llm_d_epp_per_endpoint_queue_size",
    "[ALPHA] The total number of requests pending in the model server queue for each underlying endpoint.",
    ["name", "model_server_endpoint"],
)

# --- scheduler, plugins, rewrites, info, data layer
SCHEDULER_E2E = promlite.Histogram(
    "llm_d_epp_scheduler_e2e_duration_seconds",
    "[ALPHA] End-to-end scheduling latency distribution in seconds.",
    buckets=SCHEDULER_BUCKETS,
)
SCHEDULER_ATTEMPTS = promlite.Counter(
    "llm_d_epp_scheduler_attempts_total",
    "[ALPHA] Total number of scheduling attempts.",
    ["status", "target_model_name", "endpoint_name", "namespace", "port"],
    bounded={"target_model_name": labels.MODEL_NAMES},
)
PLUGIN_DURATION = promlite.Histogram(
    "llm_d_epp_plugin_duration_seconds",
    "[ALPHA] Plugin processing latency distribution in seconds for each extension point, plugin type "
    "and plugin name.",
    ["extension_point", "plugin_type", "plugin_name"],
    buckets=PLUGIN_BUCKETS,
)
MODEL_REWRITE_DECISIONS = promlite.Counter(
    "llm_d_epp_model_rewrite_decisions_total",
    "[ALPHA] Total number of inference model rewrite decisions.",
    ["model_rewrite_name", "model_name", "target_model"],
    bounded={"model_name": labels.MODEL_NAMES, "target_model": labels.MODEL_NAMES},
)
INFO = promlite.Gauge(
    "llm_d_epp_info",
    "[ALPHA] General information of the current build of Inference Extension.",
    ["commit", "build_ref"],
)
DATALAYER_POLL_ERRORS = promlite.Counter(
    "llm_d_epp_datalayer_poll_errors_total",
    "[ALPHA] Data-source poll errors per source type.",
    ["source_type"],
)
DATALAYER_EXTRACT_ERRORS = promlite.Counter(
    "llm_d_epp_datalayer_extract_errors_total",
    "[ALPHA] Extract errors per source/extractor type.",
    ["source_type", "extractor_type"],
)

# --- ext_proc streams
EXTPROC_STREAMS_INFLIGHT = promlite.Gauge(
    "llm_d_epp_extproc_streams_inflight", "[ALPHA] Number of ext_proc gRPC streams currently open."
)
EXTPROC_STREAM_DURATION = promlite.Histogram(
    "llm_d_epp_extproc_stream_duration_seconds",
    "[ALPHA] Duration an ext_proc gRPC stream stays open, in seconds.",
    buckets=STREAM_DURATION_BUCKETS,
)
EXTPROC_STREAMS_TOTAL = promlite.Counter(
    "llm_d_epp_extproc_streams_total",
    "[ALPHA] Total ext_proc gRPC streams completed, by gRPC status code.",
    ["code"],
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
REQUEST_PROCESSING.labels()
RESPONSE_PROCESSING.labels()

_O = "inference_objective_"
_P = "inference_pool_"
_X = "inference_extension_"
DEPRECATED = (
    promlite.alias(
        REQUEST_TOTAL,
        f"{_O}request_total",
        _deprecated(
            REQUEST_TOTAL.name,
            "Counter of inference objective requests broken out for each model and target model.",
        ),
        [*M, "priority"],
    ),
    promlite.alias(
        REQUEST_ERROR_TOTAL,
        f"{_O}request_error_total",
        _deprecated(
            REQUEST_ERROR_TOTAL.name,
            "Counter of inference objective requests errors broken out for each model and target model.",
        ),
        [*M, "error_code"],
    ),
    promlite.alias(
        REQUEST_DURATION,
        f"{_O}request_duration_seconds",
        _deprecated(
            REQUEST_DURATION.name,
            "Inference objective response latency distribution in seconds for each model and target model.",
        ),
        M,
    ),
    promlite.alias(
        REQUEST_SIZES,
        f"{_O}request_sizes",
        _deprecated(
            REQUEST_SIZES.name,
            "Inference objective requests size distribution in bytes for each model and target model.",
        ),
        M,
    ),
    promlite.alias(
        RESPONSE_SIZES,
        f"{_O}response_sizes",
        _deprecated(
            RESPONSE_SIZES.name,
            "Inference objective responses size distribution in bytes for each model and target model.",
        ),
        M,
    ),
    promlite.alias(
        INPUT_TOKENS,
        f"{_O}input_tokens",
        _deprecated(
            INPUT_TOKENS.name,
            "Inference objective input token count distribution for requests in each model.",
        ),
        M,
    ),
    promlite.alias(
        OUTPUT_TOKENS,
        f"{_O}output_tokens",
        _deprecated(
            OUTPUT_TOKENS.name,
            "Inference objective output token count distribution for requests in each model.",
        ),
        M,
    ),
    promlite.alias(
        CACHED_TOKENS,
        f"{_O}prompt_cached_tokens",
        _deprecated(
            CACHED_TOKENS.name,
            "Inference objective prompt cached token count distribution for requests in each model.",
        ),
        M,
    ),
    promlite.alias(
        RUNNING_REQUESTS,
        f"{_O}running_requests",
        _deprecated(RUNNING_REQUESTS.name, "Inference objective number of running requests in each model."),
        ["model_name"],
    ),
    promlite.alias(
        NTPOT,
        f"{_O}normalized_time_per_output_token_seconds",
        _deprecated(
            NTPOT.name,
            "Inference objective latency divided by number of output tokens in seconds for each model "
            "and target model.",
        ),
        M,
    ),
    promlite.alias(
        POOL_AVG_KV,
        f"{_P}average_kv_cache_utilization",
        _deprecated(POOL_AVG_KV.name, "The average kv cache utilization for an inference server pool."),
    ),
    promlite.alias(
        POOL_AVG_QUEUE,
        f"{_P}average_queue_size",
        _deprecated(POOL_AVG_QUEUE.name, "The average number of requests pending in the model server queue."),
    ),
    promlite.alias(
        POOL_AVG_RUNNING,
        f"{_P}average_running_requests",
        _deprecated(
            POOL_AVG_RUNNING.name, "The average number of running requests across model servers in the pool."
        ),
    ),
    promlite.alias(
        POOL_READY_ENDPOINTS,
        f"{_P}ready_pods",
        _deprecated(POOL_READY_ENDPOINTS.name, "The number of ready pods in the inference server pool."),
    ),
    promlite.alias(
        POOL_PER_ENDPOINT_QUEUE,
        f"{_P}per_pod_queue_size",
        "[ALPHA] The total number of requests pending in the model server queue for each underlying pod.",
        ["name", "model_server_pod"],
        from_labels=["name", "model_server_endpoint"],
    ),
    promlite.alias(
        SCHEDULER_E2E,
        f"{_X}scheduler_e2e_duration_seconds",
        _deprecated(SCHEDULER_E2E.name, "End-to-end scheduling latency distribution in seconds."),
    ),
    promlite.alias(
        SCHEDULER_ATTEMPTS,
        f"{_X}scheduler_attempts_total",
        _deprecated(SCHEDULER_ATTEMPTS.name, "Total number of scheduling attempts."),
        ["status", "target_model_name", "pod_name", "namespace", "port"],
        from_labels=SCHEDULER_ATTEMPTS.labelnames,
    ),
    promlite.alias(
        PLUGIN_DURATION,
        f"{_X}plugin_duration_seconds",
        _deprecated(
            PLUGIN_DURATION.name,
            "Plugin processing latency distribution in seconds for each extension point, plugin type "
            "and plugin name.",
        ),
    ),
    promlite.alias(
        MODEL_REWRITE_DECISIONS,
        f"{_X}model_rewrite_decisions_total",
        "[ALPHA] Total number of inference model rewrite decisions.",
    ),
    promlite.alias(
        INFO, f"{_X}info", "[ALPHA] General information of the current build of Inference Extension."
    ),
    promlite.alias(
        DATALAYER_POLL_ERRORS,
        "llm_d_inference_scheduler_datalayer_poll_errors_total",
        _deprecated(DATALAYER_POLL_ERRORS.name, "Data-source poll errors per source type."),
    ),
    promlite.alias(
        DATALAYER_EXTRACT_ERRORS,
        "llm_d_inference_scheduler_datalayer_extract_errors_total",
        _deprecated(DATALAYER_EXTRACT_ERRORS.name, "Extract errors per source/extractor type."),
    ),
)
"""The deprecated names the reference still emits, rendered at scrape time from the current families."""

promlite.register(
    EXTPROC_STREAMS_INFLIGHT,
    EXTPROC_STREAMS_REJECTED,
    EXTPROC_BUFFERED_BYTES,
    REQUEST_TOTAL,
    REQUEST_ERROR_TOTAL,
    REQUEST_DURATION,
    REQUEST_SIZES,
    RESPONSE_SIZES,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    CACHED_TOKENS,
    RUNNING_REQUESTS,
    NTPOT,
    TTFT,
    TPOT,
    ITL,
    REQUEST_PROCESSING,
    RESPONSE_PROCESSING,
    POOL_AVG_KV,
    POOL_AVG_QUEUE,
    POOL_AVG_RUNNING,
    POOL_STD_KV,
    POOL_STD_QUEUE,
    POOL_STD_RUNNING,
    POOL_READY_ENDPOINTS,
    POOL_PER_ENDPOINT_QUEUE,
    SCHEDULER_E2E,
    SCHEDULER_ATTEMPTS,
    PLUGIN_DURATION,
    MODEL_REWRITE_DECISIONS,
    INFO,
    DATALAYER_POLL_ERRORS,
    DATALAYER_EXTRACT_ERRORS,
    *DEPRECATED,
)

_GRPC_STREAM_METRICS = (EXTPROC_STREAM_DURATION, EXTPROC_STREAMS_TOTAL)


_grpc_stream_metrics_on: list[bool] = []


def enable_grpc_stream_metrics() -> None:
    """``--enable-grpc-stream-metrics``: expose the per-stream duration and completion counter (once)."""
    if not _grpc_stream_metrics_on:
        _grpc_stream_metrics_on.append(True)
        promlite.register(*_GRPC_STREAM_METRICS)
        EXTPROC_STREAM_DURATION.labels()
        for code in ("OK", "Canceled", "Unknown", "DeadlineExceeded", "FailedPrecondition"):
            EXTPROC_STREAMS_TOTAL.labels(code)


# Error counters are served at 0 for every label set known before its first error (a rate() over a
# series that appears with its first increment misses that increment, and panels read "No data"):
# every code, per pool, for a request rejected before it was parsed; the common ones for each
# request key seen.
RequestKey = tuple[str, str, str, str, str]
"""Bound ``REQUEST_LABELS`` values: model, target model, fairness id, priority, pool."""
SEEDED_ERROR_CODES = ("BadRequest", "ResourceExhausted", "Internal", "ServiceUnavailable")
_seeded_keys: set[tuple[str, ...]] = set()
_seeded_pools: set[str] = set()


def no_key(pool: str) -> RequestKey:
    """The labels of a request of ``pool`` (a bound label) rejected before its request was parsed."""
    return ("", "", "", "", pool)


def seed_pool(pool: str) -> None:
    """Serve every error code of ``pool``'s unparsed requests at 0 (once per pool label)."""
    if pool in _seeded_pools:
        return
    _seeded_pools.add(pool)
    for code in ErrorCode:
        REQUEST_ERROR_TOTAL.at((*no_key(pool), code.text))


def pool_label(name: str) -> str:
    """The ``inference_pool`` label of a pool the EPP serves (computed once, when its runtime is built)."""
    labels.INFERENCE_POOLS.serve((name,))
    label = labels.INFERENCE_POOLS.bound(name)
    seed_pool(label)
    return label


def seed_errors(key: RequestKey) -> None:
    """Serve the common error series of a request key at 0 (once per key; keys are bounded)."""
    if key in _seeded_keys:
        return
    _seeded_keys.add(key)
    for code in SEEDED_ERROR_CODES:
        REQUEST_ERROR_TOTAL.at((*key, code))


def request_key(model: str, target: str, fairness_id: str, priority: int, pool: str = "") -> RequestKey:
    """The bounded ``REQUEST_LABELS`` values of one request, for ``Family.at`` (computed once per
    request); ``pool``: its pool's label, bound already (``pool_label``)."""
    bound = labels.MODEL_NAMES.bound
    return (bound(model), bound(target), labels.FAIRNESS_IDS.bound(fairness_id), str(priority), pool)


_plugin_children: dict[tuple[str, int], promlite.HistogramChild] = {}


def observe_plugin(extension_point: str, plugin: object, seconds: float) -> None:
    """The scheduler's plugin timer: ``llm_d_epp_plugin_duration_seconds``."""
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
