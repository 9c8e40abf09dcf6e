"""The sidecar's Prometheus metrics (its own registry, served on ``--metrics-port``).

The reference's ``llm_d_disagg_sidecar_*`` families (requests, disaggregated requests, stage
durations, stage errors), plus the decode-only fallbacks and the SSRF refusals of this sidecar.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

PREFIX = "llm_d_disagg_sidecar"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STAGE_PREFILL = "prefill"
STAGE_DECODE = "decode"
FALLBACK_REASONS = ("unreachable", "timeout", "status", "invalid_response", "allowlist_not_ready")


class SidecarMetrics:
    """One registry with every family the sidecar updates."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests handled by the sidecar, by OpenAI API type.",
            ["api_type"],
            registry=r,
        )
        self.disagg_requests = Counter(
            f"{PREFIX}_disagg_requests",
            "Requests routed through disaggregation (a prefill endpoint was named), by connector.",
            ["connector"],
            registry=r,
        )
        self.prefilled_requests = Counter(
            f"{PREFIX}_prefilled_requests",
            "Requests decoded with the KV of a remote prefill, by connector.",
            ["connector"],
            registry=r,
        )
        self.decode_only_fallbacks = Counter(
            f"{PREFIX}_decode_only_fallbacks",
            "Requests whose prefill failed and that were served decode-only, by reason.",
            ["reason"],
            registry=r,
        )
        self.ssrf_denied = Counter(
            f"{PREFIX}_ssrf_denied",
            "Requests refused (403) because the prefill endpoint is not in the pool's allow-list.",
            registry=r,
        )
        self.bad_requests = Counter(
            f"{PREFIX}_bad_requests",
            "Requests refused (400): a malformed prefill header or body, by reason.",
            ["reason"],
            registry=r,
        )
        self.prefill_duration = Histogram(
            f"{PREFIX}_prefill_duration_seconds",
            "Prefill stage latency in seconds, by connector.",
            ["connector"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_duration = Histogram(
            f"{PREFIX}_decode_duration_seconds",
            "Decode stage latency in seconds (until the last byte), by connector.",
            ["connector"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            f"{PREFIX}_request_errors",
            "Prefill/decode stage errors, by connector and stage.",
            ["connector", "stage"],
            registry=r,
        )
        for reason in FALLBACK_REASONS:
            self.decode_only_fallbacks.labels(reason)
