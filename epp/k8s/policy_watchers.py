"""Watchers of the pool's request policies: InferenceObjective (priority) and InferenceModelRewrite."""

from __future__ import annotations

from typing import Any, Protocol

from kubernetes_asyncio import client

from epp.k8s.reflector import Reflector
from epp.k8s.resources import INFERENCE_MODEL_REWRITE, INFERENCE_OBJECTIVE, Kind, name_of


class ObjectSink(Protocol):
    def upsert_object(self, obj: dict[str, Any]) -> None: ...

    def delete(self, name: str) -> None: ...


class _SinkHandler:
    def __init__(self, sink: ObjectSink) -> None:
        self.sink = sink

    def on_upsert(self, obj: dict[str, Any]) -> None:
        self.sink.upsert_object(obj)

    def on_delete(self, obj: dict[str, Any]) -> None:
        self.sink.delete(name_of(obj))

    def on_synced(self) -> None:
        return None


class PolicyWatchers:
    """Reflectors for InferenceObjective and InferenceModelRewrite in ``namespace``.

    Each feeds its store, which decides whether an object belongs to this pool (``spec.poolRef``).
    Used in InferencePool mode only. When a kind's CRD is not installed the reflector logs it and
    looks again every 30 s, so installing the CRDs later needs no restart.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        *,
        objectives: ObjectSink | None = None,
        rewrites: ObjectSink | None = None,
    ) -> None:
        pairs: list[tuple[Kind, ObjectSink]] = []
        if objectives is not None:
            pairs.append((INFERENCE_OBJECTIVE, objectives))
        if rewrites is not None:
            pairs.append((INFERENCE_MODEL_REWRITE, rewrites))
        self.reflectors = [Reflector(api, kind, namespace, _SinkHandler(sink)) for kind, sink in pairs]

    def start(self) -> None:
        for r in self.reflectors:
            r.start()

    async def stop(self) -> None:
        for r in self.reflectors:
            await r.stop()
