"""Kubernetes endpoint discovery: an InferencePool (``--pool-name``) or a label selector
(``--endpoint-selector``, standalone mode) decides which pods serve.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import structlog
from kubernetes_asyncio import client

from epp.framework import EndpointNotifier
from epp.k8s.pods import PodEndpoints, PoolSpec, parse_target_ports
from epp.k8s.reflector import Reflector
from epp.k8s.resources import POD, POOL_GROUP, inference_pool

log = structlog.get_logger("epp.k8s.pool")

StatusCallback = Callable[[bool, str], None]
DEFAULT_APP_PROTOCOLS = frozenset({"http", "kubernetes.io/h2c"})


def parse_pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """The pool's selector, ports and app protocol; ``ValueError`` naming the bad field.

    v1: ``spec.selector.matchLabels`` and ``spec.targetPorts[].number``. The pre-GA v1alpha2 pool
    (``--pool-group inference.networking.x-k8s.io``) has a flat ``spec.selector`` map and one
    ``spec.targetPortNumber``; both shapes are read.
    """
    spec = pool.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("spec: missing")
    if "targetPortNumber" in spec and "targetPorts" not in spec:
        return _parse_v1alpha2(spec)
    selector = spec.get("selector")
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels:
        raise ValueError("spec.selector.matchLabels: must be a non-empty map")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list):
        raise ValueError("spec.targetPorts: must be a list")
    try:
        numbers = parse_target_ports([p.get("number") if isinstance(p, dict) else p for p in ports])
    except ValueError as e:
        raise ValueError(f"spec.targetPorts: {e}") from None
    protocol = spec.get("appProtocol") or ""  # unset: no constraint on the parsers
    return PoolSpec(
        selector={str(k): str(v) for k, v in labels.items()},
        target_ports=numbers,
        app_protocol=str(protocol),
    )


def _parse_v1alpha2(spec: Mapping[str, Any]) -> PoolSpec:
    labels = spec.get("selector")
    if not isinstance(labels, dict) or not labels:
        raise ValueError("spec.selector: must be a non-empty map")
    try:
        ports = parse_target_ports([spec.get("targetPortNumber")])
    except ValueError as e:
        raise ValueError(f"spec.targetPortNumber: {e}") from None
    return PoolSpec(selector={str(k): str(v) for k, v in labels.items()}, target_ports=ports)


_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _valid_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _LABEL_PREFIX.fullmatch(prefix)):
        return False
    return bool(_LABEL_NAME.fullmatch(name))


def parse_endpoint_selector(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (``--endpoint-selector``, equality only, Kubernetes label syntax);
    ``ValueError`` naming the bad term otherwise, so a typo fails at start-up instead of selecting
    nothing (or being refused by the API server on every retry)."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if value.startswith("="):
            value = value[1:].strip()  # k==v means k=v
        if not sep or not key:
            raise ValueError(f'invalid label selector term "{part}": expected key=value')
        if not _valid_label_key(key):
            raise ValueError(f'invalid label key "{key}" in "{part}" (only key=value terms are supported)')
        if value and not _LABEL_NAME.fullmatch(value):
            raise ValueError(f'invalid label value "{value}" in "{part}"')
        out[key] = value
    if not out:
        raise ValueError("empty label selector")
    return out


class PoolDiscovery:
    """The endpoint source for Kubernetes.

    Pool mode: a reflector watches the one InferencePool; when it appears or its
    ``spec.selector.matchLabels`` / ``spec.targetPorts`` change, the pod reflector is (re)started with
    that selector, and its list diff is the full resync. A deleted pool, or one with an invalid spec,
    empties the endpoint store. Standalone mode: selector and ports come from the command line.

    ``on_status(ready, reason)`` reports ready once the pool was found, its pods were listed and its
    ``appProtocol`` is one the parser supports. ``start`` returns at once (a missing pool is waited
    for, not ready); the reflectors run until ``stop``.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        *,
        pool_name: str = "",
        pool_group: str = POOL_GROUP,
        spec: PoolSpec | None = None,
        metrics_port: int | None = None,
        app_protocols: Collection[str] = DEFAULT_APP_PROTOCOLS,
    ) -> None:
        if bool(pool_name) == (spec is not None):
            raise ValueError("either pool-name or endpoint-selector must be set")
        self.api = api
        self.namespace = namespace
        self.pool_name = pool_name
        self.pool_group = pool_group
        self.static_spec = spec
        self.metrics_port = metrics_port
        self.app_protocols = frozenset(app_protocols)
        self.on_status: StatusCallback | None = None
        self.ready = False
        self.reason = "not started"
        self.pods: PodEndpoints | None = None
        self.pod_reflector: Reflector | None = None
        self.pool_reflector: Reflector | None = None
        self._pool_seen = False

    @property
    def mode(self) -> str:
        return "inferencepool" if self.pool_name else "standalone"

    # --- EndpointSource ------------------------------------------------------------------------

    async def start(self, notifier: EndpointNotifier) -> None:
        await self.start_pods(notifier)
        if self.static_spec is not None:
            self._set_status(False, "listing pods")
            await self._apply_spec(self.static_spec)
            return
        self._set_status(False, f"waiting for InferencePool {self.namespace}/{self.pool_name}")
        self.pool_reflector = Reflector(
            self.api,
            inference_pool(self.pool_group),
            self.namespace,
            _PoolHandler(self),
            field_selector=f"metadata.name={self.pool_name}",
        )
        self.pool_reflector.start()

    async def start_pods(self, notifier: EndpointNotifier) -> None:
        """Ready to follow pods into ``notifier``; the pool's spec comes through ``pool_changed``
        (from ``start``'s own pool watch, or from a watch of several pools)."""
        self.pods = PodEndpoints(
            notifier, self.namespace, metrics_port=self.metrics_port, on_synced=self._pods_synced
        )
        self.pod_reflector = Reflector(self.api, POD, self.namespace, self.pods)

    async def stop(self) -> None:
        if self.pool_reflector is not None:
            await self.pool_reflector.stop()
            handler = self.pool_reflector.handler
            if isinstance(handler, _PoolHandler):
                await handler.cancel()
        if self.pod_reflector is not None:
            await self.pod_reflector.stop()

    # --- state changes -------------------------------------------------------------------------

    def _set_status(self, ready: bool, reason: str) -> None:
        if (ready, reason) == (self.ready, self.reason):
            return
        self.ready, self.reason = ready, reason
        log.info("pool status", ready=ready, reason=reason, mode=self.mode)
        if self.on_status is not None:
            self.on_status(ready, reason)

    def _pods_synced(self) -> None:
        assert self.pods is not None
        spec = self.pods.spec
        if spec is None or self.pod_reflector is None or not self.pod_reflector.synced:
            return
        if spec.app_protocol and spec.app_protocol not in self.app_protocols:
            self._set_status(False, f'appProtocol "{spec.app_protocol}" is not supported by the parser')
            return
        self._set_status(True, f"synced: {self.pods.endpoint_count} endpoints")

    async def _apply_spec(self, spec: PoolSpec | None) -> None:
        assert self.pods is not None and self.pod_reflector is not None
        previous = self.pods.spec
        self.pods.set_spec(spec)
        if spec is None:
            await self.pod_reflector.stop()
            self.pods.clear()
            self.pod_reflector.cache.clear()
            self.pod_reflector.resource_version = ""
            return
        if previous is None or self.pod_reflector.label_selector != spec.label_selector:
            log.info("watching pods", selector=spec.label_selector, ports=list(spec.target_ports))
            await self.pod_reflector.restart(label_selector=spec.label_selector)
        elif previous != spec and self.pod_reflector.synced:
            self._pods_synced()  # ports or protocol changed: endpoints were re-derived in set_spec

    # --- pool events (from _PoolHandler, in the pool reflector's task) ---------------------------

    async def pool_changed(self, pool: dict[str, Any] | None) -> None:
        if pool is None or (pool.get("metadata") or {}).get("deletionTimestamp"):
            if self._pool_seen or pool is not None:
                log.warning("InferencePool deleted; clearing endpoints", pool=self.pool_name)
            self._pool_seen = pool is not None
            self._set_status(False, f"InferencePool {self.namespace}/{self.pool_name} not found")
            await self._apply_spec(None)
            return
        self._pool_seen = True
        try:
            spec = parse_pool_spec(pool)
        except ValueError as e:
            log.error(
                "invalid InferencePool; no endpoints until it is fixed", pool=self.pool_name, error=str(e)
            )
            self._set_status(False, f"invalid InferencePool: {e}")
            await self._apply_spec(None)
            return
        applied = self.pod_reflector is not None and self.pod_reflector.label_selector == spec.label_selector
        if self.pods is not None and self.pods.spec == spec and self.ready and applied:
            return
        if self.pods is not None and self.pods.spec is None:
            self._set_status(False, "listing pods")
        await self._apply_spec(spec)


class _PoolHandler:
    """Adapts the pool reflector's synchronous callbacks to the discovery's async changes, in order."""

    def __init__(self, discovery: PoolDiscovery) -> None:
        self.discovery = discovery
        self._pending: list[dict[str, Any] | None] = []
        self._task: asyncio.Task[None] | None = None

    def on_upsert(self, obj: dict[str, Any]) -> None:
        self._submit(obj)

    def on_delete(self, obj: dict[str, Any]) -> None:
        self._submit(None)

    def on_synced(self) -> None:
        reflector = self.discovery.pool_reflector
        if reflector is not None and not reflector.cache:
            self._submit(None)

    def _submit(self, pool: dict[str, Any] | None) -> None:
        self._pending.append(pool)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending:
            # each event carries the whole pool: only the newest matters (no relist per stale spec)
            pool = self._pending[-1]
            self._pending.clear()
            try:
                await self.discovery.pool_changed(pool)
            except Exception as e:  # never leave later pool changes unapplied
                log.error("applying an InferencePool change failed", error=repr(e))

    async def cancel(self) -> None:
        self._pending.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
