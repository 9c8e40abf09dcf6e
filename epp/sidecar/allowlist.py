"""SSRF protection: the prefill endpoints the sidecar may call, kept current from the pool.

The allow-list is an endpoint notifier fed by the EPP's own discovery sources: the InferencePool's
ready pods through the Kubernetes API, or an endpoints file (as ``file-discovery`` reads it). Only
endpoints that can prefill are allowed: those ``prefill-filter`` keeps (``llm-d.ai/role`` ``prefill``,
``encode-prefill``, ``prefill-decode``, ``both`` or ``encode-prefill-decode``). A
target is matched on its exact ``host:port``, as the EPP writes it into the header. Until the source
is ready (the pool found and its pods listed), the list is not ``ready``: the sidecar then calls no
prefill endpoint at all and serves decode-only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from epp.framework import EndpointMetadata
from epp.sidecar.target import Target

log = structlog.get_logger("epp.sidecar.allowlist")

ROLE_LABEL = "llm-d.ai/role"
PREFILL_ROLES = frozenset(("prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"))


class AllowList:
    """The allowed prefill ``host:port`` set; an ``EndpointNotifier`` for discovery sources."""

    def __init__(self) -> None:
        self._endpoints: dict[str, EndpointMetadata] = {}
        self._hostports: frozenset[str] = frozenset()
        self.ready = False
        """Whether the source has delivered the pool (before that nothing is allowed)."""

    def set_ready(self, ready: bool, reason: str = "") -> None:
        if ready != self.ready:
            log.info("prefill allow-list", ready=ready, reason=reason)
        self.ready = ready

    # --- EndpointNotifier ------------------------------------------------------------------------

    def upsert(self, metadata: EndpointMetadata) -> None:
        self._endpoints[metadata.key] = metadata
        self._rebuild()

    def delete(self, key: str) -> None:
        if self._endpoints.pop(key, None) is not None:
            self._rebuild()

    def keys(self) -> frozenset[str]:
        return frozenset(self._endpoints)

    # --- queries ---------------------------------------------------------------------------------

    def allows(self, target: Target) -> bool:
        return target.hostport in self._hostports

    @property
    def hostports(self) -> frozenset[str]:
        return self._hostports

    def _rebuild(self) -> None:
        self._hostports = frozenset(
            m.hostport for m in self._endpoints.values() if m.labels.get(ROLE_LABEL) in PREFILL_ROLES
        )
        log.info("prefill allow-list", endpoints=sorted(self._hostports))


@dataclass(slots=True)
class AllowListSource:
    """A started discovery feeding an :class:`AllowList`; ``stop`` ends it."""

    description: str
    stop: Callable[[], Awaitable[None]]


async def from_file(allow: AllowList, path: str) -> AllowListSource:
    """Fill ``allow`` from the endpoints file at ``path`` and keep watching it."""
    from epp.plugins.discovery.file_discovery import FileDiscovery, FileDiscoveryParams

    source = FileDiscovery("pd-sidecar-allowlist", FileDiscoveryParams(path=path, watch_file=True))
    await source.start(allow)
    allow.set_ready(True, f"endpoints file {path}")
    return AllowListSource(f"endpoints file {path}", source.stop)


async def from_pool(allow: AllowList, namespace: str, pool: str, kubeconfig: str | None) -> AllowListSource:
    """Fill ``allow`` from the ready pods of InferencePool ``namespace/pool``, watched."""
    from epp.k8s.client import api_client
    from epp.k8s.pool_discovery import PoolDiscovery

    api = await api_client(kubeconfig)
    discovery = PoolDiscovery(api, namespace, pool_name=pool)
    discovery.on_status = allow.set_ready
    await discovery.start(allow)

    async def stop() -> None:
        await discovery.stop()
        await api.close()

    return AllowListSource(f"InferencePool {namespace}/{pool}", stop)
