"""``llm_d_epp_cross_replica_*``: how the shared routing state follows the other replicas."""

from __future__ import annotations

from epp import promlite

SYNC_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LAG_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)

SYNCS = promlite.Counter(
    "llm_d_epp_cross_replica_syncs_total", "[ALPHA] Successful round trips to the cross-replica store."
)
FAILURES = promlite.Counter(
    "llm_d_epp_cross_replica_sync_failures_total",
    "[ALPHA] Round trips to the cross-replica store that failed, by reason "
    "(timeout, connection, error); routing goes on with local state.",
    ["reason"],
)
SKIPPED = promlite.Counter(
    "llm_d_epp_cross_replica_skipped_total",
    "[ALPHA] Values and records read from the cross-replica store and not used, by reason "
    "(undecodable, invalid, wrong_type).",
    ["reason"],
)
PEERS = promlite.Gauge(
    "llm_d_epp_cross_replica_peers", "[ALPHA] Other EPP replicas seen alive at the last successful sync."
)
CONNECTED = promlite.Gauge(
    "llm_d_epp_cross_replica_connected", "[ALPHA] 1 while the last round trip to the store succeeded."
)
SYNC_DURATION = promlite.Histogram(
    "llm_d_epp_cross_replica_sync_duration_seconds",
    "[ALPHA] Duration of one round trip to the cross-replica store (publish and mirror refresh).",
    buckets=SYNC_DURATION_BUCKETS,
)
SYNC_LAG = promlite.Histogram(
    "llm_d_epp_cross_replica_sync_lag_seconds",
    "[ALPHA] Age of another replica's records when this replica applied them (its clock against ours).",
    buckets=LAG_BUCKETS,
)
DROPPED = promlite.Counter(
    "llm_d_epp_cross_replica_dropped_records_total",
    "[ALPHA] Records this replica could not publish (the store was unreachable and the backlog full).",
)
promlite.register(SYNCS, FAILURES, SKIPPED, PEERS, CONNECTED, SYNC_DURATION, SYNC_LAG, DROPPED)
for _reason in ("timeout", "connection", "error"):
    FAILURES.labels(_reason)  # served at 0 before the first failure
for _reason in ("undecodable", "invalid", "wrong_type"):
    SKIPPED.labels(_reason)
