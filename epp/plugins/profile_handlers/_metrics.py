"""Decision counters of the disaggregation profile handlers (llm-d names, labels and HELP texts).

``llm_d_inference_scheduler_pd_decision_total`` is the deprecated twin of ``..._disagg_decision_total``,
still recorded for dashboards built on it.
"""

from __future__ import annotations

from epp import labels, promlite

DECODE_ONLY = "decode-only"
PREFILL_DECODE = "prefill-decode"
ENCODE_DECODE = "encode-decode"
ENCODE_PREFILL_DECODE = "encode-prefill-decode"

DISAGG_DECISION_TOTAL = promlite.Counter(
    "llm_d_inference_scheduler_disagg_decision_total",
    "[ALPHA] Total number of disaggregation routing decisions made",
    ["model_name", "decision_type"],
    bounded={"model_name": labels.MODEL_NAMES},
)
PD_DECISION_TOTAL = promlite.Counter(
    "llm_d_inference_scheduler_pd_decision_total",
    "[ALPHA] Total number of P/D disaggregation decisions made",
    ["model_name", "decision_type"],
    bounded={"model_name": labels.MODEL_NAMES},
)
promlite.register(DISAGG_DECISION_TOTAL, PD_DECISION_TOTAL)


def decision_type(encode_used: bool, prefill_used: bool) -> str:
    """The ``decision_type`` label for the stages that produced endpoints (decode always did)."""
    if encode_used and prefill_used:
        return ENCODE_PREFILL_DECODE
    if encode_used:
        return ENCODE_DECODE
    if prefill_used:
        return PREFILL_DECODE
    return DECODE_ONLY


def record_disagg_decision(model_name: str, decision: str) -> None:
    """Count a decision in the current and in the deprecated counter."""
    model = model_name or "unknown"
    DISAGG_DECISION_TOTAL.labels(model, decision).inc()
    PD_DECISION_TOTAL.labels(model, decision).inc()


def record_pd_decision(model_name: str, decision: str) -> None:
    """Count a decision in the deprecated counter only (``pd-profile-handler``)."""
    PD_DECISION_TOTAL.labels(model_name or "unknown", decision).inc()
