"""``utilization-detector``: pool saturation from queue depth and KV-cache use, with in-flight credit.

Per endpoint: the scraped waiting queue plus the EPP's in-flight change since that scrape, against
``queueDepthThreshold``, or KV-cache use against ``kvCacheUtilThreshold``, whichever is higher;
the pool's saturation is the mean. ``stalenessPolicy`` decides what stale metrics count as. With a
cross-replica syncer the credit is the fleet's: what the other replicas sent since the scrape counts too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from epp import promlite
from epp.framework import (
    CycleState,
    Endpoint,
    Filter,
    Handle,
    LLMRequest,
    SaturationDetector,
    register,
)
from epp.framework.cross_replica import SharedValue, fold_sum, valid_count
from epp.framework.durations import parse_go_duration
from epp.framework.params import ensure_valid

log = structlog.get_logger("epp.plugins.utilization_detector")

DEFAULT_QUEUE_DEPTH_THRESHOLD = 5
DEFAULT_KV_CACHE_UTIL_THRESHOLD = 0.8
DEFAULT_METRICS_STALENESS_THRESHOLD = "200ms"
STALENESS_POLICIES = ("credit", "saturated", "ignore")

STALE_ENDPOINTS = promlite.Gauge(
    "llm_d_epp_flow_control_stale_endpoints",
    "[ALPHA] Number of candidate endpoints whose metrics are missing or older than the staleness threshold, "
    "as of the most recent saturation evaluation.",
    ["detector"],
)
promlite.register(STALE_ENDPOINTS, owners=("utilization-detector",))


@dataclass(slots=True, frozen=True)
class UtilizationDetectorParams:
    queue_depth_threshold: int = DEFAULT_QUEUE_DEPTH_THRESHOLD
    kv_cache_util_threshold: float = DEFAULT_KV_CACHE_UTIL_THRESHOLD
    metrics_staleness_threshold: str = DEFAULT_METRICS_STALENESS_THRESHOLD
    headroom: float = 0.0
    staleness_policy: str = "credit"

    @property
    def staleness_seconds(self) -> float:
        """``metricsStalenessThreshold`` in seconds (only meaningful once validated)."""
        return parse_go_duration(self.metrics_staleness_threshold) or 0.0

    def validate(self) -> str | None:
        problems: list[tuple[str, str]] = []
        if self.queue_depth_threshold <= 0:
            problems.append(
                (
                    "queueDepthThreshold",
                    f"queueDepthThreshold must be strictly positive, got {self.queue_depth_threshold}",
                )
            )
        if not 0.0 < self.kv_cache_util_threshold <= 1.0:
            problems.append(
                (
                    "kvCacheUtilThreshold",
                    f"kvCacheUtilThreshold must be in (0, 1], got {self.kv_cache_util_threshold:g}",
                )
            )
        staleness = parse_go_duration(self.metrics_staleness_threshold)
        if staleness is None:
            problems.append(
                (
                    "metricsStalenessThreshold",
                    f'metricsStalenessThreshold must be a duration such as "200ms", '
                    f"got {self.metrics_staleness_threshold!r}",
                )
            )
        elif staleness <= 0:
            problems.append(
                (
                    "metricsStalenessThreshold",
                    "metricsStalenessThreshold must be strictly positive, "
                    f"got {self.metrics_staleness_threshold}",
                )
            )
        if self.headroom < 0:
            problems.append(("headroom", f"headroom must be non-negative, got {self.headroom:g}"))
        if self.staleness_policy not in STALENESS_POLICIES:
            problems.append(
                (
                    "stalenessPolicy",
                    'stalenessPolicy must be "credit", "saturated" or "ignore", '
                    f"got {self.staleness_policy!r}",
                )
            )
        if not problems:
            return None
        reasons = "; ".join(reason for _, reason in problems)
        return f"{problems[0][0]}: invalid utilization detector configuration: {reasons}"


@register
class UtilizationDetector(SaturationDetector, Filter):
    type_name = "utilization-detector"
    Params = UtilizationDetectorParams
    params: UtilizationDetectorParams

    def __init__(
        self, name: str, params: UtilizationDetectorParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else UtilizationDetectorParams()
        ensure_valid(params)
        super().__init__(name, params, handle)
        self._queue = float(params.queue_depth_threshold)
        self._kv = params.kv_cache_util_threshold
        self._staleness = params.staleness_seconds
        self._queue_limit = self._queue * (1.0 + params.headroom)
        self._kv_limit = self._kv * (1.0 + params.headroom)
        self._ignore_stale = params.staleness_policy == "ignore"
        self._credit_stale = params.staleness_policy == "credit"
        self._stale_gauge = STALE_ENDPOINTS.labels(name)
        self._handle = handle
        # the other replicas (a syncer), by endpoint key: (in flight now, sent since our last scrape)
        self._peers: dict[str, tuple[int, int]] = {}
        self._peers_before: Mapping[str, int] = {}  # their in-flight counts of the previous sync
        self._marks: dict[str, tuple[float, int]] = {}  # scrape update_time -> their count then
        if params.headroom > 1.0:
            log.warning(
                "unusually high headroom configured; verify the value is a fraction, not a percentage",
                plugin=self.typed_name,
                headroom=params.headroom,
                effective_burst=f"{params.headroom * 100:.0f}%",
            )

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        return self.dispatch_saturation(endpoints, 0)

    def dispatch_saturation(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        """The mean endpoint saturation; ``pending`` requests count as queued, spread evenly.

        An endpoint's queue is the scraped one plus its in-flight credit: what this EPP sent there
        since the scrape began, less what it saw finish (a finished request let a queued one run),
        less the slots the scrape showed free (the most it was ever seen running, minus running).
        Stale metrics: with ``credit`` the last snapshot plus the credit since it (never scraped:
        everything in flight counts as queued); ``saturated`` counts the endpoint as 1.0;
        ``ignore`` leaves it out. With a syncer the other replicas' credit is added (their
        in-flight change since this replica's scrape, as of the last sync).
        """
        if not endpoints:
            return 1.0
        now = time.monotonic()
        staleness, q_t, kv_t = self._staleness, self._queue, self._kv
        credit_stale = self._credit_stale
        peers = self._peers
        total = 0.0
        stale = 0
        for e in endpoints:
            m = e.metrics
            updated = m.update_time
            peer = peers.get(e.metadata.key) if peers else None
            if updated <= 0.0 or now - updated > staleness:
                stale += 1
                if not credit_stale:
                    continue
                if updated <= 0.0:
                    total += (e.inflight if peer is None else e.inflight + peer[0]) / q_t
                    continue
            # sent since the scrape (or finished since): they fill the free slots first
            waiting = m.waiting_queue_size + e.inflight - m.inflight_at_scrape
            if peer is not None:
                waiting += peer[1]
            free = m.peak_running - m.running_requests_size
            if free > 0:
                waiting -= free
            q = waiting / q_t if waiting > 0 else 0.0
            kv = m.kv_cache_usage_percent / kv_t
            total += q if q > kv else kv
        self._stale_gauge.set(stale)
        n = len(endpoints)
        if pending:
            total += pending / q_t
        if self._ignore_stale:
            fresh = n - stale
            return total / fresh if fresh else 0.0
        if credit_stale:
            return total / n
        return (total + stale) / n

    # --- shared with the other replicas (a cross-replica syncer) --------------------------------

    def cross_replica_specs(self) -> list[SharedValue]:
        """Per endpoint, the requests this replica has in flight there (``Endpoint.inflight``),
        summed over the other replicas."""
        return [
            SharedValue(
                state_key=f"{self.type_name}/{self.name}",
                supply=self._supply,
                aggregate=fold_sum,
                install=self._install_peers,
                valid=valid_count,
            )
        ]

    def _supply(self) -> dict[str, int]:
        handle = self._handle
        if handle is None:
            return {}
        return {e.metadata.key: e.inflight for e in handle.endpoints() if e.inflight > 0}

    def _install_peers(self, folded: Mapping[str, Any]) -> None:
        """The peers' in-flight counts now, and their change since each endpoint's last scrape here.

        A scrape that landed since the previous sync is marked with the peers' counts of that sync
        (the ones in force when it began, to within one interval); their requests sent after it
        are the credit until the next scrape.
        """
        handle = self._handle
        if handle is None:
            return
        before, marks = self._peers_before, self._marks
        new_marks: dict[str, tuple[float, int]] = {}
        peers: dict[str, tuple[int, int]] = {}
        for e in handle.endpoints():
            key = e.metadata.key
            updated = e.metrics.update_time
            mark = marks.get(key)
            if mark is None or mark[0] != updated:
                mark = (updated, before.get(key, 0) if updated > 0.0 else 0)
            new_marks[key] = mark
            count = folded.get(key, 0)
            if count or mark[1]:
                peers[key] = (count, count - mark[1])
        self._marks = new_marks
        self._peers_before = folded
        self._peers = peers

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        now = time.monotonic()
        staleness, q_limit, kv_limit = self._staleness, self._queue_limit, self._kv_limit
        kept = []
        for e in endpoints:
            m = e.metrics
            updated = m.update_time
            if updated <= 0.0 or now - updated > staleness:
                continue
            if m.waiting_queue_size < q_limit and m.kv_cache_usage_percent < kv_limit:
                kept.append(e)
        return kept or endpoints  # fail open
