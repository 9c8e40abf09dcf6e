"""The watch behind a ``k8s-notification-source``: one kind's objects in the pool namespace.

The kind's REST resource is found through API discovery (``/api/v1`` or ``/apis/{group}/{version}``),
retried with backoff while the kind is not served; then a ``Reflector`` lists and watches it and
each add/update (a new ``resourceVersion``, relists included) or delete is handed to the source's
extractors as a ``NotificationEvent``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import structlog
from kubernetes_asyncio import client

from epp.background import BackgroundTask
from epp.datalayer.notifications import dispatch_notification
from epp.framework.interfaces import (
    DataSource,
    EventType,
    Extractor,
    GroupVersionKind,
    NotificationEvent,
    NotificationSource,
)
from epp.k8s.reflector import Reflector
from epp.k8s.resources import Kind, loads

log = structlog.get_logger("epp.k8s.notifications")

_RETRY_MIN = 0.5
_RETRY_MAX = 30.0


class NotificationWatch:
    """Feeds one notification source; ``start()`` returns at once, ``stop()`` ends the watch."""

    def __init__(
        self, api: client.ApiClient, namespace: str, source: DataSource, extractors: Sequence[Extractor]
    ) -> None:
        if not isinstance(source, NotificationSource):
            raise TypeError(f"data source {source!r} is not a notification source")
        self.api = api
        self.namespace = namespace
        self._source = cast(NotificationSource, source)
        self._source_type = source.type_name
        self._extractors = tuple(extractors)
        self.gvk: GroupVersionKind = self._source.gvk
        self.reflector: Reflector | None = None
        self._task = BackgroundTask(f"notifications-{self.gvk.kind}", self._run)

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        if self.reflector is not None:
            await self.reflector.stop()

    # --- ReflectorHandler ----------------------------------------------------------------------

    def on_upsert(self, obj: dict[str, Any]) -> None:
        self._dispatch(EventType.ADD_OR_UPDATE, obj)

    def on_delete(self, obj: dict[str, Any]) -> None:
        self._dispatch(EventType.DELETE, obj)

    def on_synced(self) -> None:
        return None

    def _dispatch(self, type_: EventType, obj: dict[str, Any]) -> None:
        dispatch_notification(
            self._source, self._source_type, self._extractors, NotificationEvent(type_, obj)
        )

    # --- start-up ------------------------------------------------------------------------------

    async def _run(self) -> None:
        delay = _RETRY_MIN
        while True:
            try:
                kind = await resolve_kind(self.api, self.gvk)
                break
            except Exception as e:
                log.warning("cannot resolve the watched kind; retrying", gvk=str(self.gvk), error=str(e))
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX)
        self.reflector = Reflector(self.api, kind, self.namespace, self)
        self.reflector.start()
        log.info("watching for the notification source", gvk=str(self.gvk), namespace=self.namespace)


async def resolve_kind(api: client.ApiClient, gvk: GroupVersionKind) -> Kind:
    """The namespaced REST resource serving ``gvk`` (``LookupError`` when none does)."""
    path = f"/apis/{gvk.group}/{gvk.version}" if gvk.group else f"/api/{gvk.version}"
    resp: Any = await api.call_api(
        path, "GET", auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True
    )
    try:
        body = await resp.read()
        status = resp.status
    finally:
        resp.release()
    if status == 404:
        raise LookupError(f"{path} is not served")
    if not 200 <= status < 300:
        raise LookupError(f"{path}: HTTP {status}")
    doc = loads(body)
    resources = doc.get("resources") if isinstance(doc, dict) else None
    for r in resources or ():
        if not isinstance(r, dict) or r.get("kind") != gvk.kind or "/" in str(r.get("name", "")):
            continue
        if not r.get("namespaced", False):
            raise LookupError(f"{gvk.kind} is cluster-scoped; only namespaced kinds can be watched")
        return Kind(gvk.group, gvk.version, str(r["name"]), gvk.kind)
    raise LookupError(f"{path} serves no kind {gvk.kind}")
