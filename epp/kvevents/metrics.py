"""Prometheus metrics of the precise prefix cache: the reference's ``llm_d_epp_kv_cache_index_*``
and ``llm_d_epp_kv_cache_events_*`` names (the index families also under their deprecated
``kvcache_*`` names, rendered at scrape time). Per-subscriber series carry the endpoint key as
``pod_identifier`` and are dropped when the endpoint leaves. The index counters are read from the
live indexes at scrape time (nothing is recorded per block).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from epp import promlite
from epp.kvcache.index import KVBlockIndex

__all__ = [
    "ACTIVE_SUBSCRIBERS",
    "DEDUP_FORWARDED",
    "DEDUP_SUPPRESSED",
    "LOOKUP_LATENCY",
    "MESSAGES_RECEIVED",
    "POOL_CAPACITY",
    "POOL_QUEUE_DEPTH",
    "RECONNECTIONS",
    "REMOVALS_SKIPPED",
    "STORES_SKIPPED",
    "ZMQ_ERRORS",
    "drop_subscriber",
    "seed_skipped",
    "seed_subscriber",
    "track_index",
]

_POD = "pod_identifier"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_live: weakref.WeakKeyDictionary[KVBlockIndex, bool] = weakref.WeakKeyDictionary()


def track_index(index: KVBlockIndex) -> None:
    """Expose ``index``'s counters (``enableMetrics``) for as long as it lives."""
    _live[index] = True


class _IndexSum:
    """An unlabelled family summed over the live indexes at scrape time: attribute ``attr`` of each
    index (``of_stats``: of its ``stats()``)."""

    _attr: str
    _of_stats: bool

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        if not _live:
            return []
        v = promlite.Value()
        for index in list(_live.keys()):
            v.value += getattr(index.stats() if self._of_stats else index, self._attr)
        return [((), v)]


class _IndexCounter(_IndexSum, promlite.Counter):
    def __init__(self, name: str, documentation: str, attr: str) -> None:
        super().__init__(name, documentation)
        self._attr, self._of_stats = attr, False


class _IndexGauge(_IndexSum, promlite.Gauge):
    def __init__(self, name: str, documentation: str, attr: str) -> None:
        super().__init__(name, documentation)
        self._attr, self._of_stats = attr, True


def _help(text: str) -> str:
    return f"[ALPHA] {text}"


def _old(current: str, text: str) -> str:
    return f"Deprecated: use {current}. {text}"


ADMISSIONS = _IndexCounter(
    "llm_d_epp_kv_cache_index_admissions_total", _help("Total number of KV-block admissions"), "admissions"
)
EVICTIONS = _IndexCounter(
    "llm_d_epp_kv_cache_index_evictions_total", _help("Total number of KV-block evictions"), "evictions"
)
LOOKUP_REQUESTS = _IndexCounter(
    "llm_d_epp_kv_cache_index_lookup_requests_total", _help("Total number of lookup calls"), "lookups"
)
MAX_POD_HITS = _IndexCounter(
    "llm_d_epp_kv_cache_index_max_pod_hit_count_total",
    _help("Longest contiguous per-pod prefix chain observed per lookup"),
    "lookup_hits",
)
LOOKUP_HITS = _IndexCounter(
    "llm_d_epp_kv_cache_index_lookup_hits_total",
    _help("Contiguous prefix blocks matched by the best pod per lookup"),
    "lookup_hits",
)
LOOKUP_LATENCY = promlite.Histogram(
    "llm_d_epp_kv_cache_index_lookup_latency_seconds",
    _help("Latency of Lookup calls in seconds"),
    buckets=_LATENCY_BUCKETS,
)
INDEX_KEYS = _IndexGauge(
    "llm_d_epp_kv_cache_index_keys", _help("Request block keys held by the KV-block index (epp)"), "keys"
)
INDEX_BYTES = _IndexGauge(
    "llm_d_epp_kv_cache_index_bytes", _help("Estimated bytes held by the KV-block index (epp)"), "bytes"
)
DEDUP_SUPPRESSED = promlite.Counter(
    "llm_d_epp_kv_cache_events_dedup_removed_hashes_suppressed_total",
    _help(
        "Block hashes whose removal was suppressed by the KV-event dedup filter (block hashes, not "
        "BlockRemoved events)"
    ),
)
DEDUP_FORWARDED = promlite.Counter(
    "llm_d_epp_kv_cache_events_dedup_removed_hashes_forwarded_total",
    _help(
        "Block hashes forwarded for eviction after the KV-event dedup filter (block hashes, not "
        "BlockRemoved events)"
    ),
)
STORES_SKIPPED = promlite.Counter(
    "llm_d_epp_kv_cache_events_stores_skipped_total",
    _help("Total number of KV-cache store events skipped before prefix indexing"),
    ("cache_kind", "reason"),
)
REMOVALS_SKIPPED = promlite.Counter(
    "llm_d_epp_kv_cache_events_removals_skipped_total",
    _help("Total number of KV-cache removal events skipped for groups excluded from prefix indexing"),
    ("cache_kind", "reason"),
)
ACTIVE_SUBSCRIBERS = promlite.Gauge(
    "llm_d_epp_kv_cache_events_active_subscribers",
    _help("Number of ZMQ subscribers currently managed, including those retrying a failed connection"),
)
RECONNECTIONS = promlite.Counter(
    "llm_d_epp_kv_cache_events_subscriber_reconnections_total",
    _help("Total number of ZMQ subscriber reconnection attempts"),
    (_POD,),
)
MESSAGES_RECEIVED = promlite.Counter(
    "llm_d_epp_kv_cache_events_messages_received_total",
    _help("Total number of messages received from ZMQ subscribers"),
    (_POD,),
)
ZMQ_ERRORS = promlite.Counter(
    "llm_d_epp_kv_cache_events_zmq_errors_total",
    _help("Total number of ZMQ subscriber errors"),
    (_POD, "operation"),
)
REPLAYS = promlite.Counter(
    "llm_d_epp_kv_cache_events_replays_total",
    _help("KV-event replays requested from an endpoint's replay socket, by outcome (epp)"),
    (_POD, "outcome"),
)
ENDPOINT_CLEARS = promlite.Counter(
    "llm_d_epp_kv_cache_events_endpoint_clears_total",
    _help("Times an endpoint's index entries were dropped because its events could not be trusted (epp)"),
    (_POD, "reason"),
)
POOL_QUEUE_DEPTH = promlite.Gauge(
    "llm_d_epp_kv_cache_events_pool_queue_depth",
    _help("Total number of messages queued across all worker shards"),
)
# The index forwards every removed hash to eviction (no tier keeps a removed block alive), so nothing
# is suppressed: the reference's counter is served at 0, as the forwarded one before its first event.
DEDUP_SUPPRESSED.labels()
DEDUP_FORWARDED.labels()
POOL_CAPACITY = promlite.Gauge(
    "llm_d_epp_kv_cache_events_pool_capacity",
    _help("Number of worker shards (capacity) in the event processing pool"),
)

promlite.register(
    ADMISSIONS,
    EVICTIONS,
    LOOKUP_REQUESTS,
    MAX_POD_HITS,
    LOOKUP_HITS,
    LOOKUP_LATENCY,
    INDEX_KEYS,
    INDEX_BYTES,
    DEDUP_SUPPRESSED,
    DEDUP_FORWARDED,
    STORES_SKIPPED,
    REMOVALS_SKIPPED,
    ACTIVE_SUBSCRIBERS,
    RECONNECTIONS,
    MESSAGES_RECEIVED,
    ZMQ_ERRORS,
    REPLAYS,
    ENDPOINT_CLEARS,
    POOL_QUEUE_DEPTH,
    POOL_CAPACITY,
    *(
        promlite.alias(fam, old, _old(fam.name, fam.documentation.removeprefix("[ALPHA] ")))
        for fam, old in (
            (ADMISSIONS, "kvcache_index_admissions_total"),
            (EVICTIONS, "kvcache_index_evictions_total"),
            (LOOKUP_REQUESTS, "kvcache_index_lookup_requests_total"),
            (MAX_POD_HITS, "kvcache_index_max_pod_hit_count_total"),
            (LOOKUP_HITS, "kvcache_index_lookup_hits_total"),
            (LOOKUP_LATENCY, "kvcache_index_lookup_latency_seconds"),
            (DEDUP_SUPPRESSED, "kvcache_kvevents_dedup_removed_hashes_suppressed_total"),
            (DEDUP_FORWARDED, "kvcache_kvevents_dedup_removed_hashes_forwarded_total"),
        )
    ),
    owners=("precise-prefix-cache-producer",),
)


# The per-subscriber error operations, served at 0 from the subscription on (``seed_subscriber``).
SUBSCRIBER_ERRORS = ("connect", "frame", "gap", "decode", "apply")
REPLAY_FAILURES = ("replay-timeout", "replay-overflow", "replay-connect", "replay-incomplete")


def seed_subscriber(pod: str) -> None:
    """Serve a new subscriber's reconnection, message and error series at 0 before their first event."""
    RECONNECTIONS.labels(pod)
    MESSAGES_RECEIVED.labels(pod)
    for operation in SUBSCRIBER_ERRORS:
        ZMQ_ERRORS.labels(pod, operation)
    for reason in (*SUBSCRIBER_ERRORS, "restart", *REPLAY_FAILURES):
        ENDPOINT_CLEARS.labels(pod, reason)
    for outcome in ("complete", "failed"):
        REPLAYS.labels(pod, outcome)


def seed_skipped(indexable: Iterable[str], other: Iterable[str]) -> None:
    """Serve the skipped-event series an engine can cause at 0: each cache kind with the reasons it
    can be skipped for."""
    for kind in indexable:
        for reason in ("invalid_block_size", "non_dense_block_span", "unknown_parent"):
            STORES_SKIPPED.labels(kind, reason)
    for kind in other:
        STORES_SKIPPED.labels(kind, "unsupported_cache_kind")
        REMOVALS_SKIPPED.labels(kind, "unsupported_cache_kind")
    REMOVALS_SKIPPED.labels("unknown", "unknown_group")


def drop_subscriber(pod: str) -> None:
    """Forget the per-subscriber series of an endpoint that left."""
    RECONNECTIONS.remove(pod)
    MESSAGES_RECEIVED.remove(pod)
    for family in (ZMQ_ERRORS, REPLAYS, ENDPOINT_CLEARS):
        for values in [v for v, _ in family._items() if v[0] == pod]:
            family.remove(*values)
