"""One priority band: its flows, caps, policies and occupancy (a ``BandView`` for fairness policies)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from epp.flowcontrol.queue import FlowQueue, Queued
from epp.flowcontrol.settings import BandSettings
from epp.framework.flow import FlowKey
from epp.framework.interfaces import FairnessPolicy, OrderingPolicy


class Band:
    """The flows of one priority. Only non-empty flows are kept, in the order they became so.

    In-flight shares are the fleet's when a cross-replica syncer is configured: ``set_peers``
    installs the other replicas' in-flight requests by flow, which ``inflight_of``,
    ``inflight_total`` and ``active_flows`` then include.
    """

    __slots__ = (
        "_flows",
        "_inflight",
        "_peers",
        "bytes",
        "fairness",
        "inflight_total",
        "length",
        "local_total",
        "ordering",
        "policy_state",
        "priority",
        "settings",
    )

    def __init__(
        self, priority: int, settings: BandSettings, fairness: FairnessPolicy, ordering: OrderingPolicy
    ) -> None:
        self.priority = priority
        self.settings = settings
        self.fairness = fairness
        self.ordering = ordering
        self.policy_state: Any = fairness.new_state()
        self._flows: dict[str, FlowQueue] = {}
        self.length = 0
        self.bytes = 0
        self._inflight: dict[str, int] = {}  # dispatched and not finished, by flow id
        self.local_total = 0  # this replica's
        self._peers: dict[str, int] = {}  # the other replicas' (a syncer), by flow id
        self.inflight_total = 0  # the fleet's: local_total plus the peers'

    def flows(self) -> Iterator[FlowQueue]:
        return iter(list(self._flows.values()))

    def flow(self, flow_id: str) -> FlowQueue | None:
        return self._flows.get(flow_id)

    def fits(self, byte_size: int) -> bool:
        s = self.settings
        if s.max_requests and self.length + 1 > s.max_requests:
            return False
        return not (s.max_bytes and self.bytes + byte_size > s.max_bytes)

    def push_out_victim(self, flow_id: str) -> Queued | None:
        """For an arrival of ``flow_id`` at a full band: the item served last of the band's longest
        flow, when that flow holds at least two more than ``flow_id`` (longest-queue push-out: a
        flow flooding the band's cap cannot crowd out the flows under their share). O(flows + the
        longest flow's items), paid only when the band is full."""
        mine = self._flows.get(flow_id)
        own = len(mine) if mine is not None else 0
        longest = max(self._flows.values(), key=len, default=None)
        if longest is None or longest.key.id == flow_id or len(longest) < own + 2:
            return None
        return max(longest.items(), key=lambda it: (it.sort_key, it.seq))

    def push(self, item: Queued) -> None:
        key = item.key
        flow = self._flows.get(key.id)
        if flow is None:
            flow = self._flows[key.id] = FlowQueue(FlowKey(key.id, key.priority))
        flow.push(item)
        self.length += 1
        self.bytes += item.byte_size

    def pop(self, flow: FlowQueue) -> Queued:
        item = flow.pop()
        self._left(flow, item)
        return item

    def remove(self, item: Queued) -> None:
        flow = self._flows.get(item.key.id)
        if flow is None or item.gone:
            return
        flow.remove(item)
        self._left(flow, item)

    def _left(self, flow: FlowQueue, item: Queued) -> None:
        self.length -= 1
        self.bytes -= item.byte_size
        if not len(flow):
            del self._flows[flow.key.id]

    def started(self, flow_id: str) -> None:
        self._inflight[flow_id] = self._inflight.get(flow_id, 0) + 1
        self.local_total += 1
        self.inflight_total += 1

    def finished(self, flow_id: str) -> None:
        n = self._inflight.get(flow_id, 0)
        if n <= 1:
            self._inflight.pop(flow_id, None)
        else:
            self._inflight[flow_id] = n - 1
        if n:
            self.local_total -= 1
            self.inflight_total -= 1

    def inflight_of(self, flow_id: str) -> int:
        n = self._inflight.get(flow_id, 0)
        peers = self._peers
        return n + peers.get(flow_id, 0) if peers else n

    def inflight_flows(self) -> Iterator[str]:
        """Fairness ids with requests in flight (here or, with a syncer, at another replica)."""
        peers = self._peers
        if not peers:
            return iter(list(self._inflight))
        return iter(list({**self._inflight, **peers}))

    def local_inflight(self) -> dict[str, int]:
        """This replica's in-flight requests by flow id (a copy)."""
        return dict(self._inflight)

    def set_peers(self, peers: dict[str, int]) -> None:
        """The other replicas' in-flight requests by flow id (positive counts)."""
        self._peers = peers
        self.inflight_total = self.local_total + sum(peers.values())

    def active_flows(self) -> int:
        """Flows with requests queued or in flight (here or, with a syncer, at another replica)."""
        flows, inflight, peers = self._flows, self._inflight, self._peers
        if peers:
            return len(flows) + len({f for f in (*inflight, *peers) if f not in flows})
        if not inflight:
            return len(flows)
        return len(flows) + sum(1 for f in inflight if f not in flows)

    def items(self) -> list[Queued]:
        return [item for flow in self._flows.values() for item in flow.items()]
