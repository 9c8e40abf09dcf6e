"""``endpoint-notification-source``: hands endpoint add/update and delete events to its extractors.

Event-driven, not polled: the data layer calls ``notify_endpoint`` when an endpoint joins, changes
in or leaves the store, and passes the event on unchanged to every ``EndpointExtractor`` wired to it.
"""

from __future__ import annotations

from epp.framework import DataSource, register
from epp.framework.interfaces import EndpointEvent

ENDPOINT_EVENTS_PAYLOAD = "endpoint-events"


@register
class EndpointNotificationSource(DataSource):
    type_name = "endpoint-notification-source"
    payload = ENDPOINT_EVENTS_PAYLOAD

    def notify_endpoint(self, event: EndpointEvent) -> EndpointEvent | None:
        return event
