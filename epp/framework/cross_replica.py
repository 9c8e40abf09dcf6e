"""Cross-replica state: the contract between EPP replicas' shared routing state and its store.

A ``CrossReplicaSyncer`` (``dataLayer.crossReplicaSyncerPluginRef``) keeps, per state key and
endpoint, one value per replica, and a log of records per state key; every read is served from a
local mirror, so the request path never waits on the store. A plugin sharing state is a
``CrossReplicaContributor``: it declares ``SharedValue`` (a per-endpoint value folded over the
replicas: ``fold_sum``, ``fold_max``, ``fold_union``) or ``SharedLog`` (records every replica
applies, e.g. "these prefix blocks went to endpoint k"). The runtime of ``epp serve`` publishes and
installs them every ``crossReplicaSyncInterval``; a contributor never sees the syncer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Fold = Callable[[Sequence[Any]], Any]
"""Folds the values replicas published for one (state key, endpoint) into one value."""


MAX_CLOCK_SKEW_SECONDS = 3600.0
"""How far ahead of this replica's clock a peer's wall-clock time may be before it is rejected."""


def fold_sum(values: Sequence[Any]) -> Any:
    """Element-wise sum of numbers, of equal-length lists of numbers (in-flight counters), or of
    mappings of numbers (summed by key: counts per flow)."""
    if not values:
        return None
    first = values[0]
    if isinstance(first, dict):
        total: dict[Any, Any] = {}
        for v in values:
            for k, x in v.items():
                total[k] = total.get(k, 0) + x
        return total
    if isinstance(first, list):
        out = [0] * len(first)
        for v in values:
            for i, x in enumerate(v[: len(out)]):
                out[i] += x
        return out
    return sum(values)


def fold_max(values: Sequence[Any]) -> Any:
    """The largest value (None when there are none)."""
    return max(values) if values else None


def fold_union(values: Sequence[Any]) -> Any:
    """The union of lists, as a sorted list."""
    out: set[Any] = set()
    for v in values:
        out.update(v)
    return sorted(out)


def valid_count(v: Any) -> bool:
    """A non-negative int below 2**53 (a JSON number every replica reads exactly), not a bool."""
    return type(v) is int and 0 <= v < 1 << 53


def valid_time(v: Any) -> bool:
    """A wall-clock time (seconds since the epoch, ``time.time()``): a positive finite number at
    most ``MAX_CLOCK_SKEW_SECONDS`` ahead of this replica's clock (a time far in the future would
    win every comparison for as long as it is kept)."""
    return type(v) in (int, float) and math.isfinite(v) and 0 < v <= time.time() + MAX_CLOCK_SKEW_SECONDS


@dataclass(frozen=True, slots=True)
class SharedValue:
    """A per-endpoint value each replica publishes and every replica reads folded over its peers.

    ``supply()`` returns this replica's values by endpoint key (JSON-serialisable; an endpoint
    missing from it is deleted for this replica). ``install(folded)`` receives, by endpoint key, the
    ``aggregate`` of the *other* live replicas' values (the contributor adds its own, which it
    knows exactly; the mapping is read-only, and the same one comes again while no peer's value
    changed); an endpoint no peer publishes is absent. ``valid(value)`` rejects a malformed
    value from the store before it is folded (skipped and counted, never trusted).
    """

    state_key: str
    supply: Callable[[], Mapping[str, Any]]
    aggregate: Fold
    install: Callable[[Mapping[str, Any]], None]
    valid: Callable[[Any], bool]


@dataclass(frozen=True, slots=True)
class SharedLog:
    """Records a replica appends and every other replica applies, in order, within a sync interval.

    ``take()`` drains this replica's new records; ``apply(records)`` applies the peers' records
    that passed ``valid``. A replica that starts reads the records still kept in the store first.
    """

    state_key: str
    take: Callable[[], list[Any]]
    apply: Callable[[list[Any]], None]
    valid: Callable[[Any], bool]


CrossReplicaSpec = SharedValue | SharedLog


@runtime_checkable
class CrossReplicaContributor(Protocol):
    """A plugin whose state replicas share. ``cross_replica_specs`` is called once, when
    ``epp serve`` starts with a syncer (never without one: sharing costs nothing until then)."""

    def cross_replica_specs(self) -> Sequence[CrossReplicaSpec]: ...


@runtime_checkable
class CrossReplicaSyncer(Protocol):
    """Per state key and endpoint, one value per replica; per state key, a log of records.

    ``set``/``delete``/``append`` only queue (they never block); ``get`` reads the mirror.
    ``sync`` is the one coroutine doing I/O: it sends what was queued and refreshes the mirror,
    raising on a store failure (the caller keeps going with the mirror it has; a mirror older
    than the store's state TTL is dropped: its replicas may be dead). Values and records from the
    store that do not decode, or that a contributor's ``valid`` rejects, are skipped and counted
    (``skip``).
    """

    replica_id: str

    def bind(self, pool: str, publish_timeout: float) -> None:
        """Namespace every key by ``pool``; ``publish_timeout`` bounds one ``sync`` (seconds)."""
        ...

    def skip(self, reason: str, n: int = 1) -> None:
        """Count ``n`` values or records from the store that were not used (``reason``: a word)."""
        ...

    def set(self, key: str, endpoint: str, value: Any) -> None: ...

    def delete(self, key: str, endpoint: str) -> None: ...

    def get(self, key: str, endpoint: str, aggregate: Fold, *, include_self: bool = True) -> Any:
        """The ``aggregate`` of the live replicas' values (None when none has one)."""
        ...

    def peer_values(self, key: str) -> Mapping[str, Sequence[Any]]:
        """Endpoint key -> the other live replicas' values for ``key`` (from the mirror). A syncer
        may return the same object while they did not change: the runtime then skips the fold."""
        ...

    def append(self, key: str, records: list[Any]) -> None: ...

    def subscribe(self, key: str) -> None:
        """Receive the other replicas' records of log ``key`` (its kept records first)."""
        ...

    def take_records(self, key: str) -> list[Any]:
        """The other replicas' records received since the last call, oldest first."""
        ...

    def peers(self) -> frozenset[str]:
        """The other replicas seen alive at the last successful sync (the peer store)."""
        ...

    async def sync(self) -> None: ...

    async def close(self) -> None: ...
