"""``k8s-notification-source``: watches one Kubernetes kind and hands its events to its extractors.

In Kubernetes mode the EPP lists and watches the ``group``/``version``/``kind`` objects of its
namespace; every add/update (a new ``resourceVersion``) and delete becomes a ``NotificationEvent``
with the object as JSON, passed to each ``NotificationExtractor`` wired to the source (their
``gvk`` must be the same). One source per kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import DataSource, register
from epp.framework.interfaces import GroupVersionKind, Handle, NotificationEvent
from epp.framework.params import ensure_valid

K8S_EVENTS_PAYLOAD = "k8s-events"


@dataclass(slots=True, frozen=True)
class K8sNotificationSourceParams:
    group: str = ""  # "" = the core API group
    version: str = ""
    kind: str = ""

    def validate(self) -> str | None:
        if not self.version or not self.kind:
            return "version: version and kind are required for k8s-notification-source"
        return None


@register
class K8sNotificationSource(DataSource):
    type_name = "k8s-notification-source"
    Params = K8sNotificationSourceParams
    payload = K8S_EVENTS_PAYLOAD

    def __init__(self, name: str, params: K8sNotificationSourceParams, handle: Handle | None = None) -> None:
        ensure_valid(params)
        super().__init__(name, params, handle)
        self._gvk = GroupVersionKind(params.group, params.version, params.kind)

    @property
    def gvk(self) -> GroupVersionKind:
        return self._gvk

    def notify(self, event: NotificationEvent) -> NotificationEvent | None:
        return event
