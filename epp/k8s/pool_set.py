"""Kubernetes discovery of several InferencePools: ``--pool-name`` repeated, or ``--pool-selector``.

One reflector lists and watches the InferencePools of ``--pool-namespace`` (with the selector's
labels); each selected pool gets a pool runtime in the registry (``epp.server.pools``) and a
``PoolDiscovery`` following its pods into that pool's store. A pool that appears starts serving; one
that is deleted, or no longer selected, stops (its requests get 404). Ready once the pool list was
read and every selected pool has synced once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any, Protocol

import structlog
from kubernetes_asyncio import client

from epp.framework import EndpointNotifier
from epp.k8s.pool_discovery import DEFAULT_APP_PROTOCOLS, PoolDiscovery
from epp.k8s.pool_policies import PoolPolicies
from epp.k8s.reflector import Reflector
from epp.k8s.resources import POOL_GROUP, inference_pool, name_of

log = structlog.get_logger("epp.k8s.pools")

CONFIG_ANNOTATION = "epp.llm-d.ai/config-map"
"""An InferencePool annotation naming a ConfigMap of the pool's namespace, ``NAME`` (its key
``config.yaml``) or ``NAME/KEY``, whose text is that pool's own ``EndpointPickerConfig``."""
CONFIG_KEY = "config.yaml"


def config_source(pool: dict[str, Any]) -> tuple[str, str] | None:
    """``(configmap, key)`` the pool's annotation names, or None (the shared config)."""
    annotations = (pool.get("metadata") or {}).get("annotations") or {}
    value = str(annotations.get(CONFIG_ANNOTATION) or "").strip()
    if not value:
        return None
    name, _, key = value.partition("/")
    return name, key or CONFIG_KEY


class PoolRegistryLike(Protocol):
    """What the pool set needs of ``epp.server.pools.PoolRegistry``."""

    def get_or_add(self, name: str, config: str | None = None) -> Any: ...

    def remove(self, name: str) -> None: ...

    multi: bool


class PoolSetDiscovery:
    """Duck-types ``PoolDiscovery`` for the server (``on_status``, ``ready``, ``start``, ``stop``);
    ``bind_pools(registry)`` before ``start``."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        *,
        names: Collection[str] = (),
        selector: str = "",
        pool_group: str = POOL_GROUP,
        metrics_port: int | None = None,
        app_protocols: Collection[str] = DEFAULT_APP_PROTOCOLS,
        policies: PoolPolicies | None = None,
    ) -> None:
        """``policies``: each pool's InferenceObjective and InferenceModelRewrite stores."""
        self.api = api
        self.policies = policies
        self._sources: dict[str, tuple[str, str] | None] = {}  # pool -> its config's ConfigMap
        self.namespace = namespace
        self.names = frozenset(names)
        self.selector = selector
        self.pool_group = pool_group
        self.metrics_port = metrics_port
        self.app_protocols = app_protocols
        self.on_status: Callable[[bool, str], None] | None = None
        self.ready = False
        self.reason = "not started"
        self.registry: PoolRegistryLike | None = None
        self.pools: dict[str, PoolDiscovery] = {}
        self._synced_once: set[str] = set()
        self._listed = False
        self._reflector: Reflector | None = None
        self._pending: list[tuple[str, dict[str, Any] | None]] = []
        self._task: asyncio.Task[None] | None = None

    def key(self, pool: dict[str, Any]) -> str:
        """A pool's name in the registry (and in the route's ``x-epp-pool``): ``NAME``, or
        ``NAMESPACE/NAME`` when every namespace is watched (``--pool-namespace ''``)."""
        if self.namespace:
            return name_of(pool)
        return f"{(pool.get('metadata') or {}).get('namespace', '')}/{name_of(pool)}"

    def bind_pools(self, registry: PoolRegistryLike) -> None:
        self.registry = registry
        registry.multi = True  # from the start, a request is matched to its pool (404 before it exists)

    async def start(self, notifier: EndpointNotifier) -> None:
        """``notifier`` (the first pool's store) is unused: each pool has its own store."""
        assert self.registry is not None, "bind_pools() first"
        self._reflector = Reflector(
            self.api,
            inference_pool(self.pool_group),
            self.namespace,
            _Handler(self),
            label_selector=self.selector,
        )
        self._set_status(False, f"listing InferencePools in {self.namespace or 'every namespace'}")
        self._reflector.start()

    async def stop(self) -> None:
        if self._reflector is not None:
            await self._reflector.stop()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for discovery in list(self.pools.values()):
            await discovery.stop()

    # --- pool events ------------------------------------------------------------------------

    def _submit(self, name: str, pool: dict[str, Any] | None) -> None:
        self._pending.append((name, pool))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending:
            name, pool = self._pending.pop(0)
            try:
                await self._apply(name, pool)
            except Exception as e:  # never leave later pool changes unapplied
                log.error("applying an InferencePool change failed", pool=name, error=repr(e))
        self._update_status()

    def _wanted(self, name: str, pool: dict[str, Any] | None) -> bool:
        if pool is None or (pool.get("metadata") or {}).get("deletionTimestamp"):
            return False
        return not self.names or name in self.names

    async def _apply(self, name: str, pool: dict[str, Any] | None) -> None:
        registry = self.registry
        assert registry is not None
        discovery = self.pools.get(name)
        wanted = self._wanted(name, pool)
        if discovery is not None and (not wanted or config_source(pool or {}) != self._sources.get(name)):
            log.info(
                "InferencePool gone or no longer selected: not served"
                if not wanted
                else "InferencePool's config annotation changed: its runtime is built again",
                pool=name,
            )
            del self.pools[name]
            self._sources.pop(name, None)
            self._synced_once.discard(name)
            await discovery.stop()
            registry.remove(name)
            if self.policies is not None:
                self.policies.detach(name)
            discovery = None
        if not wanted:
            return
        assert pool is not None
        if discovery is None:
            source = config_source(pool)
            namespace = str((pool.get("metadata") or {}).get("namespace") or self.namespace)
            text = await self._own_config(name, namespace, source) if source is not None else None
            target = registry.get_or_add(name, text)
            self._sources[name] = source
            if self.policies is not None:
                self.policies.attach(name, pool, target.director)
            discovery = PoolDiscovery(
                self.api,
                str((pool.get("metadata") or {}).get("namespace") or self.namespace),
                pool_name=name_of(pool),
                pool_group=self.pool_group,
                metrics_port=self.metrics_port,
                app_protocols=self.app_protocols,
            )
            discovery.on_status = lambda ready, reason, n=name: self._pool_status(n, ready, reason)
            await discovery.start_pods(target.store)
            self.pools[name] = discovery
            log.info("InferencePool served", pool=name, pools=len(self.pools), own_config=source)
        elif self.policies is not None:
            self.policies.pool_changed(name, pool)
        await discovery.pool_changed(pool)

    async def _own_config(self, name: str, namespace: str, source: tuple[str, str]) -> str:
        """The text of the pool's own config (``CONFIG_ANNOTATION``); raises when it can't be read,
        so the pool is not served (its requests get 404) until its InferencePool changes again."""
        config_map, key = source
        try:
            found = await client.CoreV1Api(self.api).read_namespaced_config_map(config_map, namespace)
        except Exception as e:
            log.error(
                "the InferencePool's own config cannot be read: the pool is not served",
                pool=name,
                config_map=f"{namespace}/{config_map}",
                error=str(e)[:300],
            )
            raise
        text = (found.data or {}).get(key)
        if text is None:
            log.error(
                "the InferencePool's own config has no such key: the pool is not served",
                pool=name,
                config_map=f"{namespace}/{config_map}",
                key=key,
            )
            raise KeyError(key)
        return str(text)

    def _pool_status(self, name: str, ready: bool, reason: str) -> None:
        if ready:
            self._synced_once.add(name)
        self._update_status()

    def listed(self) -> None:
        self._listed = True
        self._update_status()

    def _update_status(self) -> None:
        if not self._listed:
            return
        waiting = sorted(n for n in self.pools if n not in self._synced_once)
        missing = sorted(self.names - set(self.pools))
        if missing:
            self._set_status(False, f"waiting for InferencePool {', '.join(missing)}")
        elif waiting or self._pending:
            self._set_status(False, f"waiting for the pods of {', '.join(waiting) or 'new pools'}")
        else:
            self._set_status(True, f"synced: {len(self.pools)} InferencePools")

    def _set_status(self, ready: bool, reason: str) -> None:
        if (ready, reason) == (self.ready, self.reason):
            return
        if self.ready and not ready:
            return  # ready once every selected pool synced once: a pool joining later does not unready
        self.ready, self.reason = ready, reason
        log.info("pools status", ready=ready, reason=reason)
        if self.on_status is not None:
            self.on_status(ready, reason)


class _Handler:
    def __init__(self, owner: PoolSetDiscovery) -> None:
        self.owner = owner

    def on_upsert(self, obj: dict[str, Any]) -> None:
        self.owner._submit(self.owner.key(obj), obj)

    def on_delete(self, obj: dict[str, Any]) -> None:
        self.owner._submit(self.owner.key(obj), None)

    def on_synced(self) -> None:
        owner = self.owner
        reflector = owner._reflector
        listed = {owner.key(obj) for obj in reflector.cache.values()} if reflector is not None else set()
        for name in list(owner.pools):  # pools gone while the watch was down
            if name not in listed:
                owner._submit(name, None)
        owner.listed()
