"""``edf-ordering-policy``: earliest deadline first, the deadline being queue entry plus the TTL.

Items without a TTL have no deadline: they go after every item that has one, first come first
served among themselves.
"""

from __future__ import annotations

from epp.framework import OrderingPolicy, QueueItem, register


@register
class EdfOrderingPolicy(OrderingPolicy):
    """Orders by ``enqueued_at + ttl`` (infinity without a TTL), then by ``enqueued_at``."""

    type_name = "edf-ordering-policy"

    def sort_key(self, item: QueueItem) -> tuple[float, ...]:
        return (item.deadline, item.enqueued_at)
