"""``k8s-notification-source``: one kind's add/update/delete events reach its extractors, against
the in-process fake API server with the real kubernetes-asyncio client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client

from epp.config.loader import load_document
from epp.datalayer.runtime import DataLayer
from epp.datalayer.store import EndpointStore
from epp.framework import ConfigError, Extractor, registry
from epp.framework.interfaces import EventType, GroupVersionKind, NotificationEvent
from epp.k8s.notification_watch import NotificationWatch, resolve_kind
from epp.plugins.scraping.k8s_notification_source import K8sNotificationSource, K8sNotificationSourceParams
from tests.fakekube import FakeKube, objects
from tests.unit.polling import until

NS = "ns"
# the API version the fake server's InferenceObjective fixtures are created with
OBJECTIVE_API = str(objects.objective("ns", "x", 0)["apiVersion"])
OBJECTIVE_GVK = GroupVersionKind(
    OBJECTIVE_API.split("/")[0], OBJECTIVE_API.split("/")[1], "InferenceObjective"
)


class Recorder(Extractor):
    """A notification extractor recording (event type, name, a spec field)."""

    type_name = "test-objective-recorder"
    accepts = "k8s-events"

    def __init__(
        self, name: str, params: Any = None, handle: Any = None, gvk: GroupVersionKind = OBJECTIVE_GVK
    ):
        super().__init__(name, params, handle)
        self._gvk = gvk
        self.seen: list[tuple[EventType, str, Any]] = []

    @property
    def gvk(self) -> GroupVersionKind:
        return self._gvk

    def extract_notification(self, event: NotificationEvent) -> None:
        obj = event.object
        spec = obj.get("spec") or {}
        self.seen.append(
            (event.type, obj["metadata"]["name"], spec.get("priority", obj.get("status", {}).get("podIP")))
        )


def source(group: str, version: str, kind: str) -> K8sNotificationSource:
    return K8sNotificationSource("src", K8sNotificationSourceParams(group, version, kind))


async def test_custom_kind_events_reach_the_extractor(kube: FakeKube, api: client.ApiClient) -> None:
    kube.create(objects.objective(NS, "before", 1))
    kube.create(objects.objective("elsewhere", "other-ns", 9))  # another namespace: not watched
    recorder = Recorder("r")
    gvk = OBJECTIVE_GVK
    watch = NotificationWatch(api, NS, source(gvk.group, gvk.version, gvk.kind), [recorder])
    watch.start()
    try:
        await until(lambda: len(recorder.seen) == 1, state=lambda: str(recorder.seen))
        kube.create(objects.objective(NS, "after", 2))
        kube.patch(OBJECTIVE_API, "InferenceObjective", NS, "before", {"spec": {"priority": 5}})
        kube.delete(OBJECTIVE_API, "InferenceObjective", NS, "after")
        await until(lambda: len(recorder.seen) == 4, state=lambda: str(recorder.seen))
    finally:
        await watch.stop()
    add, delete = EventType.ADD_OR_UPDATE, EventType.DELETE
    assert recorder.seen == [(add, "before", 1), (add, "after", 2), (add, "before", 5), (delete, "after", 2)]


async def test_core_kind_events_reach_the_extractor(kube: FakeKube, api: client.ApiClient) -> None:
    pod_gvk = GroupVersionKind("", "v1", "Pod")
    recorder = Recorder("r", gvk=pod_gvk)
    watch = NotificationWatch(api, NS, source("", "v1", "Pod"), [recorder])
    watch.start()
    try:
        kube.create(objects.pod(NS, "p1", "10.1.0.1"))
        await until(lambda: len(recorder.seen) == 1, state=lambda: str(recorder.seen))
        kube.delete("v1", "Pod", NS, "p1")
        await until(lambda: len(recorder.seen) == 2, state=lambda: str(recorder.seen))
    finally:
        await watch.stop()
    assert recorder.seen == [
        (EventType.ADD_OR_UPDATE, "p1", "10.1.0.1"),
        (EventType.DELETE, "p1", "10.1.0.1"),
    ]


async def test_unknown_kind_is_reported_not_fatal(api: client.ApiClient) -> None:
    with pytest.raises(LookupError, match="serves no kind Gizmo"):
        await resolve_kind(api, GroupVersionKind("", "v1", "Gizmo"))
    kind = await resolve_kind(api, OBJECTIVE_GVK)
    assert kind.plural == "inferenceobjectives"


_GVK_PARAMS = (
    f"{{group: {OBJECTIVE_GVK.group}, version: {OBJECTIVE_GVK.version}, kind: {OBJECTIVE_GVK.kind}}}"
)


def _doc(extra: str) -> Any:
    return yaml.safe_load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- {{type: k8s-notification-source, name: objectives, parameters: {_GVK_PARAMS}}}\n" + extra
    )


def test_extractor_gvk_must_match_the_source() -> None:
    with pytest.raises(ConfigError) as e:
        load_document(
            _doc(
                "- {type: metrics-data-source}\n"
                "- {type: core-metrics-extractor}\n"
                "dataLayer:\n  sources: [{pluginRef: objectives,"
                " extractors: [{pluginRef: core-metrics-extractor}]}]\n"
            ),
            "t",
        )
    assert "requires a NotificationExtractor" in e.value.reason


def test_two_sources_for_one_kind_are_rejected() -> None:
    with pytest.raises(ConfigError) as e:
        load_document(
            _doc(
                f"- {{type: k8s-notification-source, name: again, parameters: {_GVK_PARAMS}}}\n"
                "- {type: test-objective-recorder}\n"
                "dataLayer:\n  sources:\n"
                "  - {pluginRef: objectives, extractors: [{pluginRef: test-objective-recorder}]}\n"
                "  - {pluginRef: again}\n"
            ),
            "t",
        )
    assert "duplicate notification source GVK" in e.value.reason
    assert e.value.field == "dataLayer.sources[1].pluginRef"


def test_matching_extractor_loads() -> None:
    cfg = load_document(
        _doc(
            "- {type: test-objective-recorder}\n"
            "dataLayer:\n  sources: [{pluginRef: objectives,"
            " extractors: [{pluginRef: test-objective-recorder}]}]\n"
        ),
        "t",
    )
    src, exts = cfg.data_sources[0]
    assert isinstance(src, K8sNotificationSource) and str(src.gvk) == str(OBJECTIVE_GVK)
    assert [e.name for e in exts] == ["test-objective-recorder"]


async def test_data_layer_starts_a_watch_per_notification_source(
    kube: FakeKube, api: client.ApiClient
) -> None:
    cfg = load_document(
        _doc(
            "- {type: test-objective-recorder}\n"
            "dataLayer:\n  sources: [{pluginRef: objectives,"
            " extractors: [{pluginRef: test-objective-recorder}]}]\n"
        ),
        "t",
    )
    recorder = cfg.plugins["test-objective-recorder"]
    assert isinstance(recorder, Recorder)
    layer = DataLayer(EndpointStore(), cfg.data_sources, refresh_interval=0.05)
    layer.start_watches(api, NS)
    try:
        kube.create(objects.objective(NS, "o1", 3))
        await until(
            lambda: recorder.seen == [(EventType.ADD_OR_UPDATE, "o1", 3)], state=lambda: str(recorder.seen)
        )
    finally:
        await layer.stop()


@pytest.fixture(autouse=True)
def _test_types() -> Iterator[None]:
    """Register this module's test-only extractor type for one test, then restore the registry."""
    registry.registered_types()  # import the built-ins first
    saved = dict(registry._REGISTRY)
    registry.register(Recorder)
    try:
        yield
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
