"""Replicas share the metrics scrape: with a cross-replica syncer each endpoint is scraped by one
live replica, chosen by rendezvous hashing over this replica and the peers the syncer sees, and
its snapshot reaches the others through the syncer (state ``endpoint-metrics``).

A replica skips the scrape of an endpoint another replica owns only while that owner's snapshots
keep arriving (newer than the last one, within ``grace`` seconds): when the owner dies, or the
store cannot be reached, every replica scrapes it again at once; once the dead peer expires from
the syncer's view one replica owns it. A joining replica moves only the endpoints it now wins.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from epp.datalayer.store import EndpointStore
from epp.framework.cross_replica import SharedValue
from epp.framework.endpoint import LORA_CPU, LORA_GPU, Endpoint, Metrics

STATE_KEY = "endpoint-metrics"


def _weight(replica: str, endpoint: str) -> int:
    digest = hashlib.blake2b(f"{replica}\0{endpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_owner(endpoint: str, replicas: Iterable[str]) -> str:
    """The replica with the highest weight for ``endpoint`` (ties: the smallest name)."""
    best = ""
    best_weight = -1
    for replica in replicas:
        w = _weight(replica, endpoint)
        if w > best_weight or (w == best_weight and replica < best):
            best, best_weight = replica, w
    return best


class SharedScrape:
    """Owns the assignment (``skip``) and the ``endpoint-metrics`` shared value."""

    def __init__(
        self,
        store: EndpointStore,
        replica_id: str,
        peers: Callable[[], frozenset[str]],
        staleness: float,
        grace: float,
    ) -> None:
        self._store = store
        self.replica_id = replica_id
        self._peers = peers
        self._staleness = staleness
        self.grace = grace
        self._cached_peers: frozenset[str] | None = None
        self._owned: dict[str, bool] = {}
        # per endpoint: the owner's publish time, when it arrived here, its scrape id and failure
        self._installed: dict[Endpoint, tuple[float, float, float, str]] = {}

    def spec(self) -> SharedValue:
        return SharedValue(STATE_KEY, self._supply, _newest, self._install, valid_snapshot)

    def owns(self, endpoint: Endpoint) -> bool:
        peers = self._peers()
        if peers is not self._cached_peers:
            self._cached_peers = peers
            self._owned = {}
        key = endpoint.metadata.key
        owned = self._owned.get(key)
        if owned is None:
            owned = self._owned[key] = rendezvous_owner(key, (self.replica_id, *peers)) == self.replica_id
        return owned

    def skip(self, endpoint: Endpoint) -> bool:
        """True: another live replica scrapes this endpoint and its snapshots keep arriving."""
        if self.owns(endpoint):
            return False
        got = self._installed.get(endpoint)
        return got is not None and time.monotonic() - got[1] < self.grace

    # --- the shared value --------------------------------------------------------------------

    def _supply(self) -> Mapping[str, Any]:
        now_wall, now = time.time(), time.monotonic()
        out: dict[str, Any] = {}
        for endpoint in self._store.endpoints():
            m = endpoint.metrics
            if not self.owns(endpoint) or (m.update_time == 0.0 and not m.failure):
                continue
            out[endpoint.metadata.key] = _encode(m, now_wall, now)
        return out

    def _install(self, folded: Mapping[str, Any]) -> None:
        now_wall, now = time.time(), time.monotonic()
        for key, value in folded.items():
            endpoint = self._store.get(key)
            if endpoint is None or self.owns(endpoint):
                continue
            stamp = float(value["t"])
            previous = self._installed.get(endpoint)
            if previous is not None and previous[0] >= stamp:
                continue  # nothing new from the owner
            self._installed[endpoint] = (stamp, now, value["s"], value["f"])
            if previous is not None and previous[2] == value["s"] and previous[3] == value["f"]:
                continue  # the same scrape again: the owner lives, the snapshot (its time) is unchanged
            endpoint.metrics = _decode(value, endpoint, now_wall, now, self._staleness)
        for endpoint in [e for e in self._installed if self._store.get(e.metadata.key) is not e]:
            del self._installed[endpoint]


def _encode(m: Metrics, now_wall: float, now: float) -> dict[str, Any]:
    """A compact JSON form: ``t`` the owner's wall time when published (each round: newer while
    the owner lives), ``a`` the values' age then (-1: never extracted), ``s`` the scrape's id,
    ``f`` the last failure."""
    return {
        "t": now_wall,
        "a": now - m.update_time if m.update_time else -1.0,
        "s": m.update_time,  # identifies the scrape (the owner's clock: compared, never read as time)
        "w": m.waiting_queue_size,
        "r": m.running_requests_size,
        "kv": m.kv_cache_usage_percent,
        "bs": m.cache_block_size,
        "nb": m.cache_num_blocks,
        "am": dict(m.active_models),
        "wm": dict(m.waiting_models),
        "ma": m.max_active_models,
        "sm": list(m.served_models),
        "f": m.failure,
        "la": dict(m.loaded_adapters),
        "gl": m.gpu_loaded_adapters,
        "lr": m.lora_residency,
    }


def _decode(
    v: Mapping[str, Any], endpoint: Endpoint, now_wall: float, now: float, staleness: float
) -> Metrics:
    current = endpoint.metrics
    age = float(v["a"])
    update = now - age - max(0.0, now_wall - float(v["t"])) if age >= 0.0 else 0.0
    return Metrics(
        waiting_queue_size=v["w"],
        running_requests_size=v["r"],
        kv_cache_usage_percent=float(v["kv"]),
        active_models=dict(v["am"]),
        waiting_models=dict(v["wm"]),
        max_active_models=v["ma"],
        cache_block_size=v["bs"],
        cache_num_blocks=v["nb"],
        served_models=tuple(v["sm"]),
        update_time=max(update, 1e-9) if age >= 0.0 else 0.0,
        fresh_until=update + staleness if age >= 0.0 else 0.0,
        failure=v["f"],
        inflight_at_scrape=endpoint.inflight,  # what this replica sent is not in the owner's view
        peak_running=max(current.peak_running, v["r"]),
        loaded_adapters=dict(v.get("la") or {}),  # absent from an older owner's publication
        gpu_loaded_adapters=v.get("gl", 0),
        lora_residency=bool(v.get("lr", False)),
    )


def _newest(values: Sequence[Any]) -> Any:
    return max(values, key=lambda v: v["t"]) if values else None


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 53


def _counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _count(x) for k, x in v.items())


def _levels(v: Any) -> bool:
    """A map of adapter name to residency level (``gpu`` / ``cpu``)."""
    return isinstance(v, dict) and all(
        isinstance(k, str) and level in (LORA_GPU, LORA_CPU) for k, level in v.items()
    )


def valid_snapshot(v: Any) -> bool:
    """A well-formed ``endpoint-metrics`` value."""
    try:
        return (
            isinstance(v, dict)
            and type(v["t"]) in (int, float)
            and math.isfinite(v["t"])
            and 0 < v["t"] <= time.time() + 3600
            and all(_count(v[k]) for k in ("w", "r", "bs", "nb", "ma"))
            and type(v["kv"]) in (int, float)
            and 0.0 <= v["kv"] <= 1.0
            and _counts(v["am"])
            and _counts(v["wm"])
            and isinstance(v["sm"], list)
            and all(isinstance(s, str) for s in v["sm"])
            and isinstance(v["f"], str)
            and type(v["s"]) in (int, float)
            and type(v["a"]) in (int, float)
            and math.isfinite(v["a"])
            and _levels(v.get("la", {}))
            and _count(v.get("gl", 0))
            and type(v.get("lr", False)) is bool
        )
    except (KeyError, TypeError):
        return False
