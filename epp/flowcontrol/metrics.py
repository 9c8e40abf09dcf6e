"""Flow-control metrics, named and labelled as the reference's ``llm_d_epp_flow_control_*`` families.

``fairness_id`` and the model labels are bounded (``epp.labels``); the deprecated
``inference_extension_flow_control_*`` names are rendered from the same series.
"""

from __future__ import annotations

from epp import labels, promlite

_BOUNDS = {
    "fairness_id": labels.FAIRNESS_IDS,
    "model_name": labels.MODEL_NAMES,
    "target_model_name": labels.MODEL_NAMES,
}
_MODEL = ("model_name", "target_model_name")
_QUEUE_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_CYCLE_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_P = "llm_d_epp_flow_control_"


def _a(text: str) -> str:
    return f"[ALPHA] {text}"


QUEUE_DURATION = promlite.Histogram(
    f"{_P}request_queue_duration_seconds",
    _a(
        "Distribution of total time requests spend in the Flow Control layer (from enqueue to final outcome)."
    ),
    ["fairness_id", "priority", "outcome", "inference_pool", *_MODEL],
    buckets=_QUEUE_BUCKETS,
    bounded=_BOUNDS,
)
CYCLE_DURATION = promlite.Histogram(
    f"{_P}dispatch_cycle_duration_seconds",
    _a("Distribution of time taken for each internal dispatch cycle in the Flow Control layer."),
    [],
    buckets=_CYCLE_BUCKETS,
)
ENQUEUE_DURATION = promlite.Histogram(
    f"{_P}request_enqueue_duration_seconds",
    _a("Distribution of time taken to enqueue requests into the Flow Control layer."),
    ["fairness_id", "priority", "outcome"],
    buckets=_CYCLE_BUCKETS,
    bounded={"fairness_id": labels.FAIRNESS_IDS},
)
QUEUE_SIZE = promlite.Gauge(
    f"{_P}queue_size",
    _a("Current number of requests actively held in the Flow Control queue."),
    ["fairness_id", "priority", "inference_pool", *_MODEL],
    bounded=_BOUNDS,
)
QUEUE_BYTES = promlite.Gauge(
    f"{_P}queue_bytes",
    _a("Current total size in bytes of requests actively held in the Flow Control queue."),
    ["fairness_id", "priority", "inference_pool", *_MODEL],
    bounded=_BOUNDS,
)
POOL_SATURATION = promlite.Gauge(
    f"{_P}pool_saturation",
    _a(
        "Pool saturation signal gating Flow Control dispatch: 'prefill' and 'decode' per stage, "
        "'effective' = max(prefill, decode) is the value used for gating; 1.0 is the set point."
    ),
    ["inference_pool", "stage"],
)
CAPACITY_REQUESTS = promlite.Gauge(
    f"{_P}capacity_utilization_requests",
    _a("Fraction of a priority band's effective request-count capacity currently occupied (0.0-1.0)."),
    ["priority", "inference_pool"],
)
CAPACITY_BYTES = promlite.Gauge(
    f"{_P}capacity_utilization_bytes",
    _a("Fraction of a priority band's effective byte-size capacity currently occupied (0.0-1.0)."),
    ["priority", "inference_pool"],
)
GLOBAL_CAPACITY_REQUESTS = promlite.Gauge(
    f"{_P}global_capacity_utilization_requests",
    _a("Fraction of the global request-count capacity currently occupied across all priority bands."),
    ["inference_pool"],
)
GLOBAL_CAPACITY_BYTES = promlite.Gauge(
    f"{_P}global_capacity_utilization_bytes",
    _a("Fraction of the global byte-size capacity currently occupied across all priority bands."),
    ["inference_pool"],
)
REQUESTS_TOTAL = promlite.Counter(
    f"{_P}requests_total",
    _a("Total number of requests processed by the Flow Control layer."),
    ["outcome", "priority", "inference_pool"],
)
REVOCATIONS_ISSUED = promlite.Counter(
    f"{_P}revocations_issued_total",
    _a("Total number of in-flight eviction revocations issued, labeled by the demand band's priority."),
    ["priority", "inference_pool"],
)
REVOCATIONS = promlite.Counter(
    f"{_P}revocations_total",
    _a("Total number of in-flight eviction revocations by terminal outcome (confirmed, timed_out)."),
    ["outcome", "inference_pool"],
)
RECLAIM_TARGET = promlite.Gauge(
    f"{_P}reclaim_target",
    _a("Last computed reclamation deficit, in saturation-gauge units."),
    ["inference_pool"],
)
PENDING_RECLAIM = promlite.Gauge(
    f"{_P}pending_reclaim",
    _a("Revocations issued whose streams have not ended yet."),
    ["inference_pool"],
)
REVOCATION_CONFIRMATION = promlite.Histogram(
    f"{_P}revocation_confirmation_seconds",
    _a("Time from revocation issue to confirmed stream termination."),
    ["inference_pool"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

_X = "inference_extension_flow_control_"


def _deprecated(source: promlite._Family, suffix: str) -> promlite._Family:
    return promlite.alias(
        source,
        f"{_X}{suffix}",
        f"[ALPHA] [Deprecated: Use {source.name}] {source.documentation.removeprefix('[ALPHA] ')}",
    )


DEPRECATED = (
    _deprecated(QUEUE_DURATION, "request_queue_duration_seconds"),
    _deprecated(CYCLE_DURATION, "dispatch_cycle_duration_seconds"),
    _deprecated(ENQUEUE_DURATION, "request_enqueue_duration_seconds"),
    _deprecated(QUEUE_SIZE, "queue_size"),
    _deprecated(QUEUE_BYTES, "queue_bytes"),
    _deprecated(POOL_SATURATION, "pool_saturation"),
)

promlite.register(
    QUEUE_DURATION,
    CYCLE_DURATION,
    ENQUEUE_DURATION,
    QUEUE_SIZE,
    QUEUE_BYTES,
    POOL_SATURATION,
    CAPACITY_REQUESTS,
    CAPACITY_BYTES,
    GLOBAL_CAPACITY_REQUESTS,
    GLOBAL_CAPACITY_BYTES,
    REQUESTS_TOTAL,
    REVOCATIONS_ISSUED,
    REVOCATIONS,
    RECLAIM_TARGET,
    PENDING_RECLAIM,
    REVOCATION_CONFIRMATION,
    *DEPRECATED,
    owners=("flow-control",),
)
