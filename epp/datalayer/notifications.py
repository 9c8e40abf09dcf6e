"""Notification-driven data sources: endpoint lifecycle events from the store to their extractors.

``EndpointEvents`` feeds an ``endpoint-notification-source`` (and its ``EndpointExtractor``s) with
an event per endpoint added, changed in place or removed. Kubernetes object events for a
``k8s-notification-source`` come from ``epp.k8s.notification_watch``; both hand events over with
``dispatch_notification``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import structlog

from epp.datalayer.store import EndpointStore
from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import (
    DataSource,
    EndpointEvent,
    EndpointExtractor,
    EndpointSource,
    EventType,
    Extractor,
    NotificationEvent,
    NotificationExtractor,
    NotificationSource,
)
from epp.metrics import DATALAYER_EXTRACT_ERRORS

log = structlog.get_logger("epp.datalayer.notifications")


class EndpointEvents:
    """Delivers the store's endpoint lifecycle to one endpoint source; ``start()`` once, ``stop()``."""

    def __init__(self, store: EndpointStore, source: DataSource, extractors: Sequence[Extractor]) -> None:
        if not isinstance(source, EndpointSource):
            raise TypeError(f"data source {source!r} is not an endpoint source")
        self._store = store
        self._source = cast(EndpointSource, source)
        self._name = source.typed_name
        self._extractors = [
            (
                cast(EndpointExtractor, e),
                e.typed_name,
                DATALAYER_EXTRACT_ERRORS.labels(source.type_name, e.type_name),
            )
            for e in extractors
        ]
        self._running = False
        self._subscribed = False

    def start(self) -> None:
        """Start delivering; endpoints already in the store are reported as added now."""
        if self._running:
            return
        self._running = True
        if not self._subscribed:
            self._subscribed = True
            self._store.subscribe(on_add=self._added, on_remove=self._removed, on_update=self._added)
        else:
            for endpoint in self._store.endpoints():
                self._added(endpoint)

    async def stop(self) -> None:
        self._running = False

    def _added(self, endpoint: Endpoint) -> None:
        self._deliver(EndpointEvent(EventType.ADD_OR_UPDATE, endpoint))

    def _removed(self, endpoint: Endpoint) -> None:
        self._deliver(EndpointEvent(EventType.DELETE, endpoint))

    def _deliver(self, event: EndpointEvent) -> None:
        if not self._running:
            return
        try:
            processed = self._source.notify_endpoint(event)
        except Exception as e:
            log.error("endpoint source failed to process an event", source=self._name, error=repr(e))
            return
        if processed is None:
            return
        for extractor, name, errors in self._extractors:
            try:
                extractor.extract_endpoint(processed)
            except Exception as e:
                errors.inc()
                log.error("endpoint extractor failed", extractor=name, error=repr(e))


def dispatch_notification(
    source: NotificationSource, source_type: str, extractors: Sequence[Extractor], event: NotificationEvent
) -> None:
    """Pass a Kubernetes event through ``source`` to each extractor (failures are logged, not raised)."""
    try:
        processed = source.notify(event)
    except Exception as e:
        log.error("notification source failed to process an event", source=source_type, error=repr(e))
        return
    if processed is None:
        return
    for extractor in extractors:
        try:
            cast(NotificationExtractor, extractor).extract_notification(processed)
        except Exception as e:
            DATALAYER_EXTRACT_ERRORS.labels(source_type, extractor.type_name).inc()
            log.error("notification extractor failed", extractor=extractor.typed_name, error=repr(e))
