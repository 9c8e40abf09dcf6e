"""Several InferencePools in one EPP: a runtime per pool, and the registry that picks one per request.

A pool is everything one EPP serves for one InferencePool: its endpoint store, data layer, plugin
instances (prefix index, counters), director, flow-control queues and pool gauges. With one pool the
registry is never consulted on the request path. With several, a request is for the pool its route
names (gRPC metadata ``x-epp-pool`` on the ext_proc stream), else for the one pool that holds the
endpoints of its subset hint; anything else is answered 404.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from epp import metrics
from epp.datalayer.pool_gauges import PoolGauges
from epp.datalayer.runtime import DataLayer
from epp.datalayer.store import EndpointStore
from epp.flowcontrol import FlowController
from epp.framework import Endpoint, ServingHooks
from epp.framework.endpoint import EndpointMetadata
from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.wire import POOL_LABEL, POOL_METADATA_KEY, SUBSET_KEY
from epp.server.director import Director
from epp.server.subset import subset_entries

log = structlog.get_logger("epp.pools")


@dataclass(slots=True, eq=False)
class Pool:
    """One pool's runtime. ``cfg`` is its own ``LoadedConfig`` (its own plugin instances)."""

    name: str
    cfg: Any
    store: EndpointStore
    director: Director
    flow_control: FlowController | None
    data_layer: DataLayer
    gauges: PoolGauges
    serving: list[ServingHooks] = field(default_factory=list)
    started: bool = False
    own_config: bool = False  # its own EndpointPickerConfig (a ConfigMap the pool's annotation names)
    cross_replica: Any = None  # its CrossReplicaRuntime (a redis-syncer: shared state per pool)


def route_pool(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    """The pool the route names in the ext_proc stream's gRPC metadata ("" when none)."""
    for key, value in metadata:
        if key == POOL_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""


class PoolRegistry:
    """The pools one EPP serves, by name, and which pool owns which endpoint address.

    ``multi`` is false while the EPP serves one pool the classic way: every request is that pool's.
    ``build(name, config)`` makes a pool's runtime, with the shared config or (``config`` not None)
    a config text of its own (``None``: only the first pool can exist); ``on_added`` / ``on_removed``
    start and stop one.
    """

    def __init__(
        self,
        primary: Pool,
        build: Callable[[str, str | None], Pool] | None = None,
        *,
        multi: bool = False,
    ) -> None:
        self.primary = primary
        self.pools: dict[str, Pool] = {}
        self.multi = multi
        self._build = build
        self._owner: dict[str, str] = {}  # "ip:port" -> pool name
        self._host_owner: dict[str, str] = {}  # "ip" -> pool name (bare-IP subset entries)
        self.on_added: Callable[[Pool], None] | None = None
        self.on_removed: Callable[[Pool], None] | None = None
        self._adopt(primary)
        if multi:
            metrics.seed_pool("")  # requests that match no pool count under inference_pool=""

    def _adopt(self, pool: Pool) -> None:
        self.pools[pool.name] = pool
        name = pool.name
        pool.store.subscribe(on_add=lambda e: self._own(e, name), on_remove=lambda e: self._disown(e, name))

    def _own(self, endpoint: Endpoint, name: str) -> None:
        md = endpoint.metadata
        self._owner[f"{md.address}:{md.port}"] = name
        self._host_owner.setdefault(md.address, name)

    def _disown(self, endpoint: Endpoint, name: str) -> None:
        md = endpoint.metadata
        if self._owner.get(f"{md.address}:{md.port}") == name:
            del self._owner[f"{md.address}:{md.port}"]
        if self._host_owner.get(md.address) == name:
            del self._host_owner[md.address]
            for hostport, owner in self._owner.items():  # another port of that host may remain
                if hostport.rpartition(":")[0] == md.address:
                    self._host_owner[md.address] = owner
                    break

    def owner(self, address: str, port: int) -> str | None:
        return self._owner.get(f"{address}:{port}")

    # --- pools appearing and disappearing -------------------------------------------------------

    def get_or_add(self, name: str, config: str | None = None) -> Pool:
        """The pool of that name, built (with ``config``, a config text of its own, if given) when new."""
        pool = self.pools.get(name)
        if pool is not None:
            return pool
        if self._build is None:
            raise ValueError(f"pool {name!r}: this EPP serves one pool ({self.primary.name})")
        pool = self._build(name, config)
        self._adopt(pool)
        if not self.multi:
            self.multi = True
            metrics.seed_pool("")
        log.info("pool added", pool=name, pools=len(self.pools))
        if self.on_added is not None:
            self.on_added(pool)
        return pool

    def remove(self, name: str) -> None:
        """Stop serving a pool: its requests get 404 from now on (the first pool stays, empty)."""
        pool = self.pools.get(name)
        if pool is None:
            return
        for key in sorted(pool.store.keys()):
            pool.store.delete(key)
        if pool is self.primary:
            return
        del self.pools[name]
        log.info("pool removed", pool=name, pools=len(self.pools))
        if self.on_removed is not None:
            self.on_removed(pool)

    def endpoints(self) -> tuple[Endpoint, ...]:
        """Every pool's endpoints (the in-flight gauge)."""
        if len(self.pools) == 1:
            return self.primary.store.endpoints()
        return tuple(e for p in self.pools.values() for e in p.store.endpoints())

    # --- the request path -----------------------------------------------------------------------

    def select(self, named: str, metadata: dict[str, dict[str, Any]]) -> Pool:
        """The pool a request is for: the one its route names, else the subset hint's; 404 if none."""
        if named:
            pool = self.pools.get(named)
            if pool is None:
                raise InferenceError(
                    ErrorCode.NOT_FOUND,
                    f"no InferencePool {named!r} is served here (named by the route's ext_proc metadata "
                    f"{POOL_METADATA_KEY}); pools: {self._names()}",
                )
            return pool
        entries = subset_entries(metadata)
        if entries:
            owners = {o for o in map(self._entry_owner, entries) if o is not None}
            if len(owners) == 1:
                return self.pools[owners.pop()]
            if owners:
                raise InferenceError(
                    ErrorCode.BAD_REQUEST,
                    f"the subset hint {SUBSET_KEY} names endpoints of several pools "
                    f"({', '.join(sorted(owners))})",
                )
            raise InferenceError(
                ErrorCode.NOT_FOUND,
                f"no pool served here has the endpoints of the subset hint {SUBSET_KEY} "
                f"({', '.join(entries[:8])}); pools: {self._names()}",
            )
        if not self.multi:
            return self.primary
        raise InferenceError(
            ErrorCode.NOT_FOUND,
            f"no InferencePool for this request: its route names none (ext_proc metadata "
            f"{POOL_METADATA_KEY}) and it has no subset hint ({SUBSET_KEY}); pools: {self._names()}",
        )

    def _entry_owner(self, entry: str) -> str | None:
        owner = self._owner.get(entry)
        if owner is not None:
            return owner
        if entry.startswith("[") or entry.count(":") == 1:
            host = entry.rpartition(":")[0].strip("[]")
            if entry.rpartition(":")[2].isdigit():
                return self._owner.get(f"{host}:{entry.rpartition(':')[2]}")
        return self._host_owner.get(entry)

    def _names(self, limit: int = 20) -> str:
        names = sorted(self.pools)
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more


class PoolNotifier:
    """The endpoint notifier of a discovery that reports several pools (an endpoints file grouped
    by ``pool``): each endpoint goes to the store of the pool its ``POOL_LABEL`` names (the first
    pool without one). An endpoint whose address another pool already has is refused: an
    endpoint belongs to one pool."""

    def __init__(self, registry: PoolRegistry, problem: Callable[[str], None] | None = None) -> None:
        self.registry = registry
        self._pool_of: dict[str, str] = {}  # endpoint key -> pool name
        self._problem = problem
        self._refused: set[str] = set()

    def upsert(self, metadata: EndpointMetadata) -> None:
        registry = self.registry
        name = metadata.labels.get(POOL_LABEL) or registry.primary.name
        owner = registry.owner(metadata.address, metadata.port)
        previous = self._pool_of.get(metadata.key)
        if owner is not None and owner != name and owner != previous:
            message = (
                f"endpoint {metadata.key} ({metadata.address}:{metadata.port}) of pool {name!r} "
                f"is already in pool {owner!r}: an endpoint belongs to one pool; ignored"
            )
            if metadata.key not in self._refused:
                self._refused.add(metadata.key)
                log.error("endpoint in two pools", endpoint=metadata.key, pool=name, owner=owner)
                if self._problem is not None:
                    self._problem(message)
            return
        if previous is not None and previous != name:
            self.delete(metadata.key)
        try:
            pool = registry.get_or_add(name)
        except ValueError as e:
            log.error("endpoint of an unknown pool ignored", endpoint=metadata.key, error=str(e))
            return
        self._pool_of[metadata.key] = name
        pool.store.upsert(metadata)

    def delete(self, key: str) -> None:
        self._refused.discard(key)
        name = self._pool_of.pop(key, None)
        if name is None:
            return
        pool = self.registry.pools.get(name)
        if pool is not None:
            pool.store.delete(key)
            if not len(pool.store) and pool is not self.registry.primary:
                self.registry.remove(name)

    def keys(self) -> frozenset[str]:
        return frozenset(self._pool_of)


def check_overlaps(pools: Sequence[tuple[str, Sequence[EndpointMetadata]]]) -> list[str]:
    """Config-time errors: an endpoint (address and port) listed in more than one pool."""
    seen: dict[str, str] = {}
    errors: list[str] = []
    for name, endpoints in pools:
        for md in endpoints:
            hostport = f"{md.address}:{md.port}"
            other = seen.setdefault(hostport, name)
            if other != name:
                errors.append(f"endpoint {hostport} ({md.key}) is in pools {other!r} and {name!r}")
    return errors
