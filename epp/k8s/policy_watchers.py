"""Watchers of the pool's request policies: InferenceObjective (priority) and InferenceModelRewrite.

Each kind exists in two API groups: ``llm-d.ai`` (current) and ``inference.networking.x-k8s.io``
(deprecated). Discovery decides which one is watched, once per kind: ``llm-d.ai`` whenever its CRD is
installed (objects of the deprecated group are then ignored, even ones of the same name), else the
deprecated group. While neither CRD is installed, discovery is asked again every 30 s.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import aiohttp
import structlog
from kubernetes_asyncio import client

from epp.background import BackgroundTask
from epp.k8s.reflector import MISSING_RETRY, Reflector
from epp.k8s.resources import (
    INFERENCE_MODEL_REWRITE,
    INFERENCE_OBJECTIVE,
    LEGACY_INFERENCE_MODEL_REWRITE,
    LEGACY_INFERENCE_OBJECTIVE,
    ApiError,
    Kind,
    name_of,
    served,
)

log = structlog.get_logger("epp.k8s")


class ObjectSink(Protocol):
    def upsert_object(self, obj: dict[str, Any]) -> None: ...

    def delete(self, name: str) -> None: ...


class _SinkHandler:
    def __init__(self, sink: ObjectSink) -> None:
        self.sink = sink

    def on_upsert(self, obj: dict[str, Any]) -> None:
        self.sink.upsert_object(obj)

    def on_delete(self, obj: dict[str, Any]) -> None:
        by_object = getattr(self.sink, "delete_object", None)  # a sink for several namespaces
        if by_object is not None:
            by_object(obj)
        else:
            self.sink.delete(name_of(obj))

    def on_synced(self) -> None:
        return None


class PolicyWatch:
    """One kind: find the group the API server serves it in, then keep a reflector on it.

    ``kind`` is the chosen group's kind (None until one is found); ``last_error`` says why there is
    none yet, or is the reflector's.
    """

    def __init__(
        self, api: client.ApiClient, namespace: str, current: Kind, legacy: Kind, sink: ObjectSink
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.candidates = (current, legacy)
        self.sink = sink
        self.kind: Kind | None = None
        self.reflector: Reflector | None = None
        self._error = ""
        self._task = BackgroundTask(f"policy-{current.plural}", self._run)

    @property
    def last_error(self) -> str:
        return self.reflector.last_error if self.reflector is not None else self._error

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        if self.reflector is not None:
            await self.reflector.stop()

    async def choose(self) -> Kind | None:
        """The first candidate the API server serves (``llm-d.ai`` before the deprecated group)."""
        current, legacy = self.candidates
        if await served(self.api, current):
            if await served(self.api, legacy):
                log.warning(
                    f"both the {legacy.group} and the {current.group} {current.kind} CRDs are installed: "
                    f"watching {current.group} only, {legacy.group} objects are ignored",
                    kind=current.kind,
                )
            return current
        if await served(self.api, legacy):
            log.warning(
                f"DEPRECATION: {legacy.api_version} {legacy.kind} is deprecated, "
                f"use {current.api_version} (watching {legacy.group} because only its CRD is installed)",
                kind=legacy.kind,
            )
            return legacy
        return None

    async def _run(self) -> None:
        while self.kind is None:
            try:
                self.kind = await self.choose()
            except asyncio.CancelledError:
                raise
            except (ApiError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
                self._error = f"discovery failed: {type(e).__name__}: {e}"
                log.warning("API discovery failed; retrying", kind=self.candidates[0].kind, error=self._error)
                await asyncio.sleep(2.0)
                continue
            if self.kind is None:
                groups = " nor ".join(k.group for k in self.candidates)
                self._error = f"404: neither {groups} serves {self.candidates[0].kind} (CRD not installed)"
                log.warning(
                    "CRD not installed; looking again later",
                    kind=self.candidates[0].kind,
                    groups=[k.group for k in self.candidates],
                    retry_s=MISSING_RETRY,
                )
                await asyncio.sleep(MISSING_RETRY)
        self._error = ""
        self.reflector = Reflector(self.api, self.kind, self.namespace, _SinkHandler(self.sink))
        self.reflector.start()


class PolicyWatchers:
    """``PolicyWatch``es for InferenceObjective and InferenceModelRewrite in ``namespace``.

    Each feeds its store, which decides whether an object belongs to this pool (``spec.poolRef``).
    Used in InferencePool mode only. Installing a missing CRD later needs no restart; the group,
    once chosen, is kept until the process restarts.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        *,
        objectives: ObjectSink | None = None,
        rewrites: ObjectSink | None = None,
    ) -> None:
        self.watches: list[PolicyWatch] = []
        if objectives is not None:
            self.watches.append(
                PolicyWatch(api, namespace, INFERENCE_OBJECTIVE, LEGACY_INFERENCE_OBJECTIVE, objectives)
            )
        if rewrites is not None:
            self.watches.append(
                PolicyWatch(api, namespace, INFERENCE_MODEL_REWRITE, LEGACY_INFERENCE_MODEL_REWRITE, rewrites)
            )

    def start(self) -> None:
        for w in self.watches:
            w.start()

    async def stop(self) -> None:
        for w in self.watches:
            await w.stop()
