"""``fcfs-ordering-policy``: first come, first served within a flow (the default ordering)."""

from __future__ import annotations

from epp.framework import OrderingPolicy, QueueItem, register


@register
class FcfsOrderingPolicy(OrderingPolicy):
    """Orders by the time the item entered flow control (ties: arrival order)."""

    type_name = "fcfs-ordering-policy"

    def sort_key(self, item: QueueItem) -> tuple[float, ...]:
        return (item.enqueued_at,)
