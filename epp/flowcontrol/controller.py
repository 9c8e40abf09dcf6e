"""The flow controller: queues requests by priority band and flow, and releases them as the pool frees up.

``admit`` queues a request and returns once it is dispatched (or raises its rejection). A dispatch
cycle compares the pool's saturation (the detector's, counting the requests released but not routed
yet) with each band's ceiling (the usage-limit policy's), highest priority first, stops at the first
gated band, and otherwise dispatches the head of the flow the band's fairness policy picks. Cycles
run when a request arrives, when one finishes (``kick``) and on a short tick while anything waits.

With a cross-replica syncer the controller is a contributor (``cross_replica_specs``): each band's
in-flight requests by flow are summed over the replicas, so in-flight fairness shares are the
fleet's; the detector shares its own credit.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from epp.flowcontrol import metrics as m
from epp.flowcontrol.band import Band
from epp.flowcontrol.queue import FlowQueue, Queued
from epp.flowcontrol.settings import FlowControlSettings
from epp.framework.cross_replica import SharedValue, fold_sum, valid_count
from epp.framework.endpoint import Endpoint
from epp.framework.errors import DroppedReason, ErrorCode, InferenceError, dropped
from epp.framework.flow import FlowKey, FlowView
from epp.framework.interfaces import SaturationDetector
from epp.framework.request import LLMRequest
from epp.framework.roles import INTERLEAVED_ROLES, PREFILL_ROLES, ROLE_DECODE, ROLE_LABEL

log = structlog.get_logger("epp.flowcontrol")

DISPATCHED = "Dispatched"
REJECTED_CAPACITY = "RejectedCapacity"
REJECTED_NO_ENDPOINTS = "RejectedNoEndpoints"
REJECTED_OTHER = "RejectedOther"
EVICTED_TTL = "EvictedTTL"
EVICTED_NO_ENDPOINTS = "EvictedNoEndpoints"
EVICTED_CONTEXT_CANCELLED = "EvictedContextCancelled"
EVICTED_OTHER = "EvictedOther"

MAX_MESSAGE_TIMEOUT = 3600.0  # the generated Envoy bootstraps' max_message_timeout, in seconds
DEFAULT_TICK = 0.005  # seconds between dispatch cycles while requests wait
REVOCATION_TIMEOUT = 5.0  # a revoked stream that has not ended by then no longer holds eviction back
_MAX_CYCLES_PER_PUMP = 512  # then yield to the event loop and go on
_REFRESH_DELAY = 0.05  # seconds from a request's end to the idle saturation gauges' refresh
_CAPACITY_MIN_SATURATION = 0.5  # the concurrency capacity is measured from cycles at least this saturated
_CAPACITY_SMOOTHING = 0.2  # weight of each new measurement of the concurrency capacity
_MAX_PUSH_OUTS = 64  # queued items pushed out for one arrival (more only when their bytes differ)
SHARED_STATE_KEY = "flow-control/inflight"
MAX_SHARED_FLOW_ID = 1024  # characters; a longer fairness id's share stays with its replica
MAX_SHARED_FLOWS = 100_000  # per band and replica


class Permit:
    """A dispatched request's hold on the pool: *pending* until it is routed (``release``: the
    endpoint's in-flight count takes over), and in its flow's in-flight share until it ends
    (``done``). Both are idempotent; a request whose routing fails calls both.
    """

    __slots__ = ("_band", "_controller", "_flow", "_routed")

    def __init__(self, controller: FlowController, band: Band, flow: str) -> None:
        self._controller = controller
        self._band: Band | None = band
        self._flow = flow
        self._routed = False

    def release(self) -> None:
        if not self._routed:
            self._routed = True
            self._controller._pending -= 1
            self._controller.kick()

    def done(self) -> None:
        self.release()
        band = self._band
        if band is not None:
            self._band = None
            band.finished(self._flow)
            self._controller.kick()
            self._controller.refresh_soon()


def _rejection(outcome: str, empty_pool: bool) -> InferenceError:
    """The HTTP error of a flow-control outcome, worded and tagged as the reference's."""
    if outcome == REJECTED_CAPACITY:
        return dropped(
            ErrorCode.RESOURCE_EXHAUSTED,
            "request rejected pre-queue: queue at capacity",
            DroppedReason.SATURATED,
        )
    if outcome == REJECTED_NO_ENDPOINTS:
        return dropped(
            ErrorCode.SERVICE_UNAVAILABLE,
            "no endpoints available: request rejected pre-queue: no endpoints available",
            DroppedReason.NO_ENDPOINTS,
        )
    if outcome == EVICTED_NO_ENDPOINTS or (outcome == EVICTED_TTL and empty_pool):
        return dropped(
            ErrorCode.SERVICE_UNAVAILABLE,
            "request timed out in queue and no endpoints are available: "
            "request evicted from queue: request TTL expired: no endpoints available",
            DroppedReason.NO_ENDPOINTS,
        )
    if outcome == EVICTED_TTL:
        return dropped(
            ErrorCode.RESOURCE_EXHAUSTED,
            "request timed out in queue: request evicted from queue: request TTL expired",
            DroppedReason.TTL_EXPIRED,
        )
    if outcome == EVICTED_CONTEXT_CANCELLED:
        return dropped(
            ErrorCode.SERVICE_UNAVAILABLE,
            "client disconnected: request evicted from queue: request context cancelled",
            DroppedReason.CONTEXT_CANCELLED,
        )
    return dropped(
        ErrorCode.SERVICE_UNAVAILABLE,
        "flow controller shutting down: flow controller is not running",
        DroppedReason.SHUTTING_DOWN,
    )


def _give_way() -> InferenceError:
    """A new error each time: a raised exception keeps its traceback, so none is shared."""
    return dropped(
        ErrorCode.RESOURCE_EXHAUSTED,
        "sheddable request rejected: higher-priority requests are waiting for the pool (flow control "
        "eviction)",
        DroppedReason.SATURATED,
    )


def _pushed_out() -> InferenceError:
    return dropped(
        ErrorCode.RESOURCE_EXHAUSTED,
        "request evicted from queue: queue at capacity, its room given to a flow under its fair share",
        DroppedReason.SATURATED,
    )


def _stages(pool: Sequence[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]] | None:
    """(prefill, decode) endpoints by role label, interleaved ones in both; None without prefill pods.

    Unlabelled endpoints are decode; encode-only and unknown roles take no prefill or decode work.
    """
    prefill: list[Endpoint] = []
    decode: list[Endpoint] = []
    for e in pool:
        role = e.metadata.labels.get(ROLE_LABEL)
        if role is None or role == ROLE_DECODE or role == "":
            decode.append(e)
        elif role in PREFILL_ROLES:
            prefill.append(e)
        elif role in INTERLEAVED_ROLES:
            prefill.append(e)
            decode.append(e)
    if not prefill:
        return None
    return prefill, decode


def _valid_flows(v: Any) -> bool:
    """``{flow id: in-flight requests}``: bounded string keys, counts."""
    return (
        isinstance(v, dict)
        and len(v) <= MAX_SHARED_FLOWS
        and all(isinstance(k, str) and len(k) <= MAX_SHARED_FLOW_ID and valid_count(n) for k, n in v.items())
    )


@dataclass(slots=True, eq=False)
class Victim:
    """An in-flight sheddable request that eviction may revoke (``revoke`` ends its stream with 429)."""

    priority: int
    revoke: Callable[[], None]
    seq: int
    revoked_at: float = 0.0


class FlowController:
    """Per-replica flow control over one pool (``pool()`` returns its current endpoints)."""

    def __init__(
        self,
        settings: FlowControlSettings,
        detector: SaturationDetector,
        pool: Callable[[], Sequence[Endpoint]],
        *,
        pool_name: str = "",
        tick: float = DEFAULT_TICK,
    ) -> None:
        self.settings = settings
        self.detector = detector
        self._pool = pool
        self.pool_name = pool_name
        self.tick = tick
        self._bands: dict[int, Band] = {}
        self._order: list[Band] = []  # every band, highest priority first
        self._seq = itertools.count()
        self._pending = 0  # dispatched, not routed yet
        self._capacity = 0.0  # the pool's measured concurrency capacity in requests (0: unknown)
        self.queued = 0
        self.queued_bytes = 0
        self._closed = False
        self._empty = False  # the pool had no endpoints at the last look
        self._regime_since = 0.0  # when the pool last became empty or non-empty
        self._tick_handle: asyncio.TimerHandle | None = None
        self._kick_handle: asyncio.Handle | None = None
        self._refresh_handle: asyncio.TimerHandle | None = None
        self._sat_effective = m.POOL_SATURATION.labels(pool_name, "effective")
        self._ceilings: list[float] = []
        # eviction: in-flight sheddable requests by priority, in dispatch order; revocations pending
        self._victims: dict[int, dict[int, Victim]] = {}
        self._revoking: dict[int, Victim] = {}
        self._next_reclaim = 0.0
        self._reclaim_target = m.RECLAIM_TARGET.labels(pool_name)
        self._pending_reclaim = m.PENDING_RECLAIM.labels(pool_name)
        self._peer_inflight: dict[int, dict[str, int]] = {}  # priority -> flow -> the peers' (a syncer)

    # --- bands ---------------------------------------------------------------------------------

    def reconfigure(self, settings: FlowControlSettings) -> None:
        """New caps, TTLs and bands (a config reload); each band keeps its queue and policies, a
        queued request keeps the TTL it was admitted with."""
        self.settings = settings
        for priority, band in self._bands.items():
            band.settings = settings.band(priority)

    def _band(self, priority: int) -> Band:
        band = self._bands.get(priority)
        if band is None:
            s = self.settings.band(priority)
            band = self._bands[priority] = Band(priority, s, s.fairness, s.ordering)
            self._order = sorted(self._bands.values(), key=lambda b: -b.priority)
            peers = self._peer_inflight.get(priority)
            if peers:
                band.set_peers(peers)
        return band

    # --- shared with the other replicas (a cross-replica syncer) -------------------------------

    def cross_replica_specs(self) -> list[SharedValue]:
        """Per priority band, ``{flow id: in-flight requests}``, summed over the other replicas."""
        return [
            SharedValue(
                state_key=SHARED_STATE_KEY,
                supply=self._supply_inflight,
                aggregate=fold_sum,
                install=self._install_peers,
                valid=_valid_flows,
            )
        ]

    def _supply_inflight(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for band in self._order:
            if band.local_total:
                flows = {f: n for f, n in band.local_inflight().items() if len(f) <= MAX_SHARED_FLOW_ID}
                if flows:
                    out[str(band.priority)] = flows
        return out

    def _install_peers(self, folded: Mapping[str, Any]) -> None:
        peers: dict[int, dict[str, int]] = {}
        for key, flows in folded.items():
            try:
                priority = int(key)
            except ValueError:
                continue  # not a band key: nothing here reads it
            counts = {f: n for f, n in flows.items() if n > 0}
            if counts:
                peers[priority] = counts
        if not peers and not self._peer_inflight:
            return
        self._peer_inflight = peers
        for band in self._order:
            band.set_peers(peers.get(band.priority, {}))
        self.kick()  # a peer's requests that finished may leave room for a flow held back

    def _fits(self, band: Band, size: int) -> bool:
        s = self.settings
        if s.max_requests and self.queued + 1 > s.max_requests:
            return False
        if s.max_bytes and self.queued_bytes + size > s.max_bytes:
            return False
        return band.fits(size)

    # --- the request's side --------------------------------------------------------------------

    async def admit(
        self, request: LLMRequest, received_at: float, on_queued: Callable[[], None] | None = None
    ) -> Permit:
        """Queue ``request`` and wait until it is dispatched; raises its rejection otherwise.

        ``on_queued`` is called when the request has to wait (it was not dispatched at once).
        Cancelling the caller (the client went away) takes the request out of the queue at once.
        """
        now = time.monotonic()
        priority = request.priority
        prio = str(priority)
        if self._closed:
            self._count(REJECTED_OTHER, prio)
            raise _rejection(REJECTED_OTHER, False)
        empty = not self._look(now)
        band = self._band(priority)
        size = request.request_size_bytes
        if self.settings.eviction and priority < 0 and self._backlog_above(priority):
            self._count(REJECTED_CAPACITY, prio)
            raise _give_way()
        if not self._fits(band, size) and not empty:
            self._push_out(band, request.fairness_id, size)
        if not self._fits(band, size):
            outcome = REJECTED_NO_ENDPOINTS if empty else REJECTED_CAPACITY
            self._count(outcome, prio)
            m.ENQUEUE_DURATION.labels(request.fairness_id, prio, outcome).observe(time.monotonic() - now)
            raise _rejection(outcome, empty)
        key = FlowKey(request.fairness_id, priority)
        item = Queued(
            request=request,
            key=key,
            byte_size=size,
            seq=next(self._seq),
            enqueued_at=now,
            received_at=received_at,
            ttl=self.settings.request_ttl if band.settings.request_ttl is None else band.settings.request_ttl,
        )
        item.sort_key = band.ordering.sort_key(item)
        self._push(band, item)
        self._pump()
        if not item.gone:
            loop = asyncio.get_running_loop()
            item.future = loop.create_future()
            self._arm(item, loop)
            self._ensure_tick(loop)
            m.ENQUEUE_DURATION.labels(request.fairness_id, prio, "NotYetFinalized").observe(
                time.monotonic() - now
            )
            if on_queued is not None:
                on_queued()
            try:
                await item.future
            except asyncio.CancelledError:
                if not item.gone:
                    self._drop(band, item, EVICTED_CONTEXT_CANCELLED)
                elif item.outcome == DISPATCHED:  # dispatched as the client left
                    Permit(self, band, key.id).done()
                raise
        else:
            m.ENQUEUE_DURATION.labels(request.fairness_id, prio, DISPATCHED).observe(time.monotonic() - now)
        return Permit(self, band, key.id)

    def kick(self) -> None:
        """Capacity may have freed (a request finished or was routed): run dispatch cycles soon."""
        if self.queued and self._kick_handle is None and not self._closed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._kick_handle = loop.call_soon(self._on_kick)

    def refresh_soon(self) -> None:
        """A request ended: while nothing is queued no dispatch cycle runs, so the saturation gauges
        are brought up to date shortly after (at most every ``_REFRESH_DELAY``), not left at their
        value of the last busy moment."""
        if self.queued or self._refresh_handle is not None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._refresh_handle = loop.call_later(_REFRESH_DELAY, self._refresh)

    def _refresh(self) -> None:
        self._refresh_handle = None
        if self.queued:  # the dispatch cycles keep the gauges current
            return
        self._sat_effective.set(self._saturation(self._pool()))

    def _on_kick(self) -> None:
        self._kick_handle = None
        self._pump()

    # --- queue bookkeeping ---------------------------------------------------------------------

    def _push(self, band: Band, item: Queued) -> None:
        band.push(item)
        self.queued += 1
        self.queued_bytes += item.byte_size
        self._gauges(band, item, 1)

    def _gauges(self, band: Band, item: Queued, sign: int) -> None:
        r = item.request
        labels = (item.key.id, str(band.priority), self.pool_name, r.incoming_model, r.target_model)
        m.QUEUE_SIZE.at(labels).inc(sign)
        m.QUEUE_BYTES.at(labels).inc(sign * item.byte_size)
        s = band.settings
        prio = str(band.priority)
        if s.max_requests:
            m.CAPACITY_REQUESTS.labels(prio, self.pool_name).set(band.length / s.max_requests)
        if s.max_bytes:
            m.CAPACITY_BYTES.labels(prio, self.pool_name).set(band.bytes / s.max_bytes)
        g = self.settings
        if g.max_requests:
            m.GLOBAL_CAPACITY_REQUESTS.labels(self.pool_name).set(self.queued / g.max_requests)
        if g.max_bytes:
            m.GLOBAL_CAPACITY_BYTES.labels(self.pool_name).set(self.queued_bytes / g.max_bytes)

    def _left(self, band: Band, item: Queued, outcome: str) -> None:
        """``item`` left ``band``'s queue with ``outcome``: counters, timer, metrics."""
        self.queued -= 1
        self.queued_bytes -= item.byte_size
        self._gauges(band, item, -1)
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None
        item.outcome = outcome
        prio = str(band.priority)
        self._count(outcome, prio)
        r = item.request
        m.QUEUE_DURATION.labels(
            item.key.id, prio, outcome, self.pool_name, r.incoming_model, r.target_model
        ).observe(time.monotonic() - item.enqueued_at)

    def _drop(self, band: Band, item: Queued, outcome: str, error: InferenceError | None = None) -> None:
        """Take a queued item out with a rejection (its waiter gets the error, unless it left)."""
        band.remove(item)
        self._left(band, item, outcome)
        future = item.future
        if future is not None and not future.done():
            future.set_exception(error or _rejection(outcome, self._empty))

    def _push_out(self, band: Band, flow_id: str, size: int) -> None:
        """Make room in a full band for ``flow_id`` by pushing out the longest flow's last items
        (429 ``EvictedOther``), while that flow holds more than the arriving one."""
        for _ in range(_MAX_PUSH_OUTS):
            victim = band.push_out_victim(flow_id)
            if victim is None:
                return
            self._drop(band, victim, EVICTED_OTHER, _pushed_out())
            if self._fits(band, size):
                return

    def _count(self, outcome: str, prio: str) -> None:
        m.REQUESTS_TOTAL.labels(outcome, prio, self.pool_name).inc()

    # --- the pool's regime and TTLs ------------------------------------------------------------

    def _look(self, now: float) -> Sequence[Endpoint]:
        """The pool's endpoints now; a change of regime (empty or not) restarts every queued TTL budget."""
        pool = self._pool()
        empty = not pool
        if empty != self._empty:
            self._empty = empty
            self._regime_since = now
            if self.queued:
                loop = asyncio.get_running_loop()
                for band in self._order:
                    for item in band.items():
                        self._arm(item, loop)
        return pool

    def _due(self, item: Queued) -> float:
        """When ``item`` expires under the current regime (infinity: never)."""
        ttl = self.settings.no_endpoint_ttl if self._empty else item.ttl
        if ttl <= 0:
            return float("inf")
        start = item.enqueued_at if item.enqueued_at > self._regime_since else self._regime_since
        return start + ttl

    def _arm(self, item: Queued, loop: asyncio.AbstractEventLoop) -> None:
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None
        due = self._due(item)
        if due != float("inf"):
            # time.monotonic() and the loop's clock are the same clock on every supported platform
            item.timer = loop.call_at(loop.time() + (due - time.monotonic()), self._expire, item)

    def _expire(self, item: Queued) -> None:
        item.timer = None
        if item.gone:
            return
        now = time.monotonic()
        self._look(now)
        if item.gone or item.timer is not None:  # re-armed by a regime change
            return
        if now + 1e-4 < self._due(item):
            self._arm(item, asyncio.get_running_loop())
            return
        band = self._bands[item.key.priority]
        self._drop(band, item, EVICTED_NO_ENDPOINTS if self._empty else EVICTED_TTL)

    # --- dispatch ------------------------------------------------------------------------------

    def _ensure_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._tick_handle is None and self.queued and not self._closed:
            self._tick_handle = loop.call_later(self.tick, self._on_tick)

    def _on_tick(self) -> None:
        self._tick_handle = None
        self._pump()
        if self.queued:
            self._ensure_tick(asyncio.get_running_loop())

    def _pump(self) -> None:
        """Dispatch cycles until one dispatches nothing (bounded, then continued on the next turn)."""
        for _ in range(_MAX_CYCLES_PER_PUMP):
            if not self.queued or not self._cycle():
                return
        self.kick()

    def _saturation(self, pool: Sequence[Endpoint]) -> float:
        """max(prefill, decode) saturation when the pool has prefill pods, else the pool's."""
        detector, pending = self.detector, self._pending
        stages = _stages(pool)
        try:
            if stages is None:
                return detector.dispatch_saturation(pool, pending)
            prefill, decode = stages
            m.POOL_SATURATION.labels(self.pool_name, "prefill").set(
                sat_p := detector.dispatch_saturation(prefill, pending)
            )
            sat_d = detector.dispatch_saturation(decode, pending) if decode else 0.0
            m.POOL_SATURATION.labels(self.pool_name, "decode").set(sat_d)
            return sat_p if sat_p > sat_d else sat_d
        except Exception as e:  # a broken detector must not stall the queue forever
            log.error("saturation detector failed; dispatching as unsaturated", error=repr(e))
            return 0.0

    def _cycle(self) -> bool:
        """One dispatch cycle; True when it dispatched a request."""
        t0 = time.perf_counter()
        try:
            now = time.monotonic()
            pool = self._look(now)
            if not pool:
                return False  # no endpoints: requests wait (noEndpointRequestTTL)
            sat = self._saturation(pool)
            self._sat_effective.set(sat)
            active = [b for b in self._order if b.length]
            if not active:
                return False
            ceilings = self._ceilings
            n = len(active)
            if len(ceilings) != n:
                ceilings = self._ceilings = [1.0] * n
            else:
                for i in range(n):
                    ceilings[i] = 1.0
            policy = self.settings.usage_limit
            if policy is not None:
                try:
                    policy.compute_limit(sat, [b.priority for b in active], ceilings)
                except Exception as e:
                    log.error("usage limit policy failed; no band ceilings this cycle", error=repr(e))
                    for i in range(n):
                        ceilings[i] = 1.0
            for i, band in enumerate(active):
                if sat >= ceilings[i]:
                    if self.settings.eviction:
                        self._give_way(active[i + 1 :], band)
                        if self._victims:
                            self._reclaim(band, sat - ceilings[i], now)
                    return False  # head-of-line gating: lower bands wait too
                caps = self._caps(band, sat)
                try:
                    flow = band.fairness.pick(band)
                except Exception as e:
                    log.error("fairness policy failed", band=band.priority, error=repr(e))
                    flow = next(band.flows(), None)
                if caps:
                    flow = self._under_cap(band, flow, caps)
                    if flow is None:
                        return False  # every queued flow is at its cap: the room is kept for them
                if not isinstance(flow, FlowQueue) or not len(flow):
                    continue
                if band.fairness.share_in_flight and self._over_share(band, flow):
                    under = self._under_share(band)
                    if under is not None:
                        flow = under  # max-min: a flow under its share goes first
                    elif self._last_room(pool, sat, ceilings[i]):
                        return False  # the last request's room is kept for the band's other flows
                self._dispatch(band, flow)
                return True
            return False
        finally:
            m.CYCLE_DURATION.observe(time.perf_counter() - t0)

    def _caps(self, band: Band, sat: float) -> Mapping[str, float] | None:
        """The band's fairness policy's in-flight caps for this cycle, given the pool's concurrency
        capacity, measured here: the requests in flight over the saturation they cause, smoothed,
        from cycles that find the pool at least half saturated. Below that, nothing is capped (the
        policy is given 0.0), so a capacity that grew is measured again before caps hold it."""
        capacity = 0.0
        if sat >= _CAPACITY_MIN_SATURATION:
            inflight = 0
            for b in self._order:
                inflight += b.inflight_total
            if inflight:
                estimate = inflight / sat
                c = self._capacity
                self._capacity = estimate if c <= 0.0 else c + _CAPACITY_SMOOTHING * (estimate - c)
            capacity = self._capacity
        try:
            return band.fairness.flow_caps(band, capacity)
        except Exception as e:
            log.error("fairness policy failed on caps", band=band.priority, error=repr(e))
            return None

    @staticmethod
    def _under_cap(band: Band, flow: FlowView | None, caps: Mapping[str, float]) -> FlowQueue | None:
        """``flow`` when it is under its cap, else the band's first queued flow that is."""
        if isinstance(flow, FlowQueue) and len(flow):
            fid = flow.key.id
            if band.inflight_of(fid) < caps.get(fid, math.inf):
                return flow
        for other in band.flows():
            fid = other.key.id
            if band.inflight_of(fid) < caps.get(fid, math.inf):
                return other
        return None

    @property
    def capacity(self) -> float:
        """The pool's measured concurrency capacity in requests (0.0: not measured yet)."""
        return self._capacity

    def _over_share(self, band: Band, flow: FlowQueue) -> bool:
        """Whether ``flow`` holds more than its share of the band's in-flight requests while
        another flow of the band has requests queued or in flight."""
        active = band.active_flows()
        return active > 1 and band.inflight_of(flow.key.id) * active > band.inflight_total

    def _last_room(self, pool: Sequence[Endpoint], sat: float, ceiling: float) -> bool:
        """Whether one more request would reach ``ceiling`` (its saturation step, from the detector)."""
        try:
            step = self.detector.dispatch_saturation(pool, self._pending + 1) - sat
        except Exception:
            return False
        return step > 0.0 and sat + step >= ceiling - 1e-9

    def _under_share(self, band: Band) -> FlowQueue | None:
        """A queued flow of ``band`` at or under its share of the band's in-flight requests."""
        active, total = band.active_flows(), band.inflight_total
        for flow in band.flows():
            if band.inflight_of(flow.key.id) * active <= total:
                return flow
        return None

    def _dispatch(self, band: Band, flow: FlowQueue) -> None:
        item = band.pop(flow)
        band.started(flow.key.id)
        self._left(band, item, DISPATCHED)
        self._pending += 1
        try:
            band.fairness.dispatched(band, item)
        except Exception as e:
            log.error("fairness policy failed on dispatch", band=band.priority, error=repr(e))
        future = item.future
        if future is not None and not future.done():
            future.set_result(None)

    # --- eviction ------------------------------------------------------------------------------

    def track(self, priority: int, revoke: Callable[[], None]) -> Victim | None:
        """A routed request: with ``enableEviction``, a sheddable one (priority < 0) may be revoked
        later; ``untrack`` it when its stream ends."""
        if not self.settings.eviction or priority >= 0:
            return None
        victim = Victim(priority, revoke, next(self._seq))
        self._victims.setdefault(priority, {})[victim.seq] = victim
        return victim

    def untrack(self, victim: Victim) -> None:
        """The victim's stream ended (served, failed, or revoked: a revocation is confirmed here)."""
        group = self._victims.get(victim.priority)
        if group is not None and group.pop(victim.seq, None) is not None and not group:
            del self._victims[victim.priority]
        if self._revoking.pop(victim.seq, None) is not None:
            now = time.monotonic()
            m.REVOCATIONS.labels("confirmed", self.pool_name).inc()
            m.REVOCATION_CONFIRMATION.labels(self.pool_name).observe(now - victim.revoked_at)
            self._next_reclaim = now + self.detector.reclaim_grace
            self._pending_reclaim.set(len(self._revoking))
            self.kick()

    def _backlog_above(self, priority: int) -> bool:
        return any(b.length for b in self._order if b.priority > priority)

    def _give_way(self, lower: Sequence[Band], blocked: Band) -> None:
        """Queued sheddable requests below the gated ``blocked`` band leave the queue (429): they
        could only dispatch once that demand is served, so they would wait out their TTL."""
        for band in lower:
            if band.priority >= 0 or band.priority >= blocked.priority:
                continue
            for item in band.items():
                self._drop(band, item, EVICTED_OTHER, _give_way())

    def _reclaim(self, band: Band, deficit: float, now: float) -> None:
        """``band`` is gated: revoke the newest in-flight request of the lowest priority below it.

        One revocation at a time: the next waits until the last one's stream ended and the
        detector's ``reclaim_grace`` passed (or ``REVOCATION_TIMEOUT``), so that the freed capacity
        shows in the saturation before more is taken.
        """
        self._reclaim_target.set(deficit)
        for seq, victim in list(self._revoking.items()):
            if now - victim.revoked_at > REVOCATION_TIMEOUT:
                del self._revoking[seq]
                m.REVOCATIONS.labels("timed_out", self.pool_name).inc()
        if self._revoking or now < self._next_reclaim:
            return
        lowest = min(self._victims)
        if lowest >= band.priority:
            return  # nothing in flight ranks below the waiting demand
        group = self._victims[lowest]
        seq = next(reversed(group))  # newest dispatch first
        victim = group.pop(seq)
        if not group:
            del self._victims[lowest]
        victim.revoked_at = now
        self._revoking[victim.seq] = victim
        self._pending_reclaim.set(len(self._revoking))
        m.REVOCATIONS_ISSUED.labels(str(band.priority), self.pool_name).inc()
        try:
            victim.revoke()
        except Exception as e:
            log.error("revoking an in-flight request failed", error=repr(e))

    # --- shutdown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Reject every queued request (503 ``rejected-shutting-down``) and all that come later."""
        self._closed = True
        for handle in (self._tick_handle, self._kick_handle, self._refresh_handle):
            if handle is not None:
                handle.cancel()
        self._tick_handle = self._kick_handle = self._refresh_handle = None
        for band in self._order:
            for item in band.items():
                self._drop(band, item, EVICTED_OTHER)

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def wait_budget(self) -> float:
        """The longest a request may wait here plus scheduling time, in seconds (Envoy's timer)."""
        longest = self.settings.longest_ttl()
        return MAX_MESSAGE_TIMEOUT if longest <= 0 else min(MAX_MESSAGE_TIMEOUT, longest + 10.0)
