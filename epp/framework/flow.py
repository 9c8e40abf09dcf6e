"""Flow-control data types: flow keys, queued items and the read-only views policies see.

A *flow* is the queue of one (fairness id, priority) pair; a *band* holds the flows of one priority.
Ordering policies give each item a sort key once, when it is queued; fairness policies pick, per
dispatch, the flow of a band whose head goes next; usage-limit policies set per-band saturation
ceilings. The controller that owns the queues lives in ``epp.flowcontrol``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from epp.framework.request import LLMRequest


@dataclass(slots=True, frozen=True)
class FlowKey:
    """The identity of one flow: the fairness id and the priority band it is queued in."""

    id: str
    priority: int

    def __str__(self) -> str:
        return f"{self.id}:{self.priority}"


@dataclass(slots=True, eq=False)
class QueueItem:
    """One request waiting in flow control.

    ``seq`` is the logical arrival order (unique, increasing); ``enqueued_at`` and ``received_at``
    are ``time.monotonic()`` of admission to the queue and of the request's arrival at the EPP;
    ``ttl`` is the queue-wait budget in seconds while the pool has endpoints (0: none). ``sort_key``
    is set by the flow's ordering policy when the item is queued (smaller goes first).
    """

    request: LLMRequest
    key: FlowKey
    byte_size: int
    seq: int
    enqueued_at: float
    received_at: float
    ttl: float
    sort_key: tuple[float, ...] = ()
    state: dict[str, Any] = field(default_factory=dict)  # per-item policy scratch space

    @property
    def deadline(self) -> float:
        """``enqueued_at + ttl`` (infinity without a TTL)."""
        return self.enqueued_at + self.ttl if self.ttl > 0 else float("inf")


class FlowView(Protocol):
    """A non-empty flow queue as a fairness policy sees it."""

    @property
    def key(self) -> FlowKey: ...

    def __len__(self) -> int: ...

    @property
    def byte_size(self) -> int: ...

    def peek(self) -> QueueItem:
        """The item this flow dispatches next (the smallest ``sort_key``, then ``seq``)."""
        ...


class BandView(Protocol):
    """One priority band as a fairness policy sees it."""

    @property
    def priority(self) -> int: ...

    @property
    def policy_state(self) -> Any:
        """What the band's fairness policy returned from ``new_state`` for this band."""
        ...

    def flows(self) -> Iterator[FlowView]:
        """The band's non-empty flows, in the order they first became non-empty (stable)."""
        ...

    def flow(self, flow_id: str) -> FlowView | None:
        """The non-empty flow with this fairness id, or None."""
        ...

    @property
    def inflight_total(self) -> int:
        """The band's requests dispatched and not finished (the fleet's, with a syncer)."""
        ...

    def inflight_of(self, flow_id: str) -> int:
        """The in-flight requests of this fairness id in the band."""
        ...

    def inflight_flows(self) -> Iterator[str]:
        """The fairness ids with requests in flight in the band."""
        ...
