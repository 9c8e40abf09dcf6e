"""``slo-deadline-ordering-policy``: earliest TTFT deadline first (``x-llm-d-slo-ttft-ms``).

The deadline is the request's arrival at the EPP plus its time-to-first-token SLO. Requests without
one go after every request that has one, in arrival order among themselves.
"""

from __future__ import annotations

from epp.framework import OrderingPolicy, QueueItem, register

# The largest SLO a deadline is computed for: beyond it the value is treated as absent, like a
# millisecond count that no longer fits a signed 64-bit nanosecond duration.
MAX_SLO_MS = float((2**63 - 1) // 1_000_000)
_NO_DEADLINE = float("inf")


@register
class SloDeadlineOrderingPolicy(OrderingPolicy):
    """Orders by ``received_at + slo_ttft_ms / 1000`` (infinity without an SLO), then by
    ``received_at``."""

    type_name = "slo-deadline-ordering-policy"

    def sort_key(self, item: QueueItem) -> tuple[float, ...]:
        return (slo_deadline(item), item.received_at)


def slo_deadline(item: QueueItem) -> float:
    """The item's TTFT deadline (``time.monotonic()`` scale), infinity when it has no usable SLO."""
    ms = item.request.slo_ttft_ms
    if not 0.0 < ms <= MAX_SLO_MS:  # also NaN
        return _NO_DEADLINE
    return item.received_at + ms / 1000.0
