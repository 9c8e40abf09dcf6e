"""Decision counters of the disaggregation profile handlers (llm-d names, labels and HELP texts).

Recorded per plugin under ``llm_d_epp_{disagg,pd}_decision_total``; the deprecated
``llm_d_inference_scheduler_*`` twins (without the plugin labels) are rendered from them at scrape time.
``disagg-profile-handler`` counts disagg decisions, the deprecated ``pd-profile-handler`` pd decisions.
"""

from __future__ import annotations

from epp import labels, promlite

DECODE_ONLY = "decode-only"
PREFILL_DECODE = "prefill-decode"
ENCODE_DECODE = "encode-decode"
ENCODE_PREFILL_DECODE = "encode-prefill-decode"

_LABELS = ("plugin_name", "plugin_type", "model_name", "decision_type")
DISAGG_DECISION_TOTAL = promlite.Counter(
    "llm_d_epp_disagg_decision_total",
    "[ALPHA] Total number of disaggregation routing decisions made",
    _LABELS,
    bounded={"model_name": labels.MODEL_NAMES},
)
PD_DECISION_TOTAL = promlite.Counter(
    "llm_d_epp_pd_decision_total",
    "[ALPHA] Total number of P/D disaggregation decisions made",
    _LABELS,
    bounded={"model_name": labels.MODEL_NAMES},
)
promlite.register(
    DISAGG_DECISION_TOTAL,
    PD_DECISION_TOTAL,
    promlite.alias(
        DISAGG_DECISION_TOTAL,
        "llm_d_inference_scheduler_disagg_decision_total",
        "[ALPHA] [Deprecated: Use llm_d_epp_disagg_decision_total] Total number of disaggregation routing "
        "decisions made",
        ("model_name", "decision_type"),
    ),
    promlite.alias(
        PD_DECISION_TOTAL,
        "llm_d_inference_scheduler_pd_decision_total",
        "[ALPHA] [Deprecated: Use llm_d_epp_pd_decision_total] Total number of P/D disaggregation "
        "decisions made",
        ("model_name", "decision_type"),
    ),
    owners=("disagg-profile-handler", "pd-profile-handler"),
)


def decision_type(encode_used: bool, prefill_used: bool) -> str:
    """The ``decision_type`` label for the stages that produced endpoints (decode always did)."""
    if encode_used and prefill_used:
        return ENCODE_PREFILL_DECODE
    if encode_used:
        return ENCODE_DECODE
    if prefill_used:
        return PREFILL_DECODE
    return DECODE_ONLY


def record_disagg_decision(plugin_name: str, plugin_type: str, model_name: str, decision: str) -> None:
    """Count a ``disagg-profile-handler`` decision."""
    DISAGG_DECISION_TOTAL.labels(plugin_name, plugin_type, model_name or "unknown", decision).inc()


def record_pd_decision(plugin_name: str, plugin_type: str, model_name: str, decision: str) -> None:
    """Count a ``pd-profile-handler`` decision."""
    PD_DECISION_TOTAL.labels(plugin_name, plugin_type, model_name or "unknown", decision).inc()
