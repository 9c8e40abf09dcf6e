"""InferenceObjective and InferenceModelRewrite for an EPP serving several InferencePools.

One watch per kind feeds a ``PolicyFanOut``, which keeps every object it saw and hands each to the
stores of the pools it applies to: every pool has its own ``ObjectiveStore`` and ``RewriteStore``
(``spec.poolRef`` names one pool, ``spec.poolRefs`` several, ``spec.poolSelector`` those whose
labels match; objects apply to the pools of their own namespace only). A pool that appears, or
whose labels change, is given the objects again, so it gets exactly those that apply to it now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.rewrites import RewriteStore


class _Store(Protocol):
    pool_labels: Mapping[str, str]

    def upsert_object(self, obj: Mapping[str, Any]) -> None: ...

    def delete(self, name: str) -> None: ...


S = TypeVar("S", bound=_Store)


def _namespace(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    namespace = meta.get("namespace") if isinstance(meta, Mapping) else None
    return namespace if isinstance(namespace, str) else ""


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


@dataclass(slots=True)
class _Member(Generic[S]):
    namespace: str
    store: S


@dataclass(slots=True)
class PolicyFanOut(Generic[S]):
    """The objects of one kind, by ``namespace/name``, and every pool's store of that kind."""

    new_store: Callable[[str, Mapping[str, str]], S]  # (pool name, pool labels) -> its empty store
    objects: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    members: dict[str, _Member[S]] = field(default_factory=dict)

    # --- the watch's side (ObjectSink) -----------------------------------------------------------

    def upsert_object(self, obj: Mapping[str, Any]) -> None:
        namespace = _namespace(obj)
        self.objects[(namespace, _name(obj))] = obj
        for member in self.members.values():
            if not namespace or member.namespace == namespace:
                member.store.upsert_object(obj)

    def delete_object(self, obj: Mapping[str, Any]) -> None:
        namespace, name = _namespace(obj), _name(obj)
        self.objects.pop((namespace, name), None)
        for member in self.members.values():
            if not namespace or member.namespace == namespace:
                member.store.delete(name)

    def delete(self, name: str) -> None:
        for key in [k for k in self.objects if k[1] == name]:
            self.delete_object({"metadata": {"namespace": key[0], "name": name}})

    # --- the pools' side ---------------------------------------------------------------------------

    def attach(self, key: str, namespace: str, pool_name: str, labels: Mapping[str, str]) -> S:
        """The store of the pool ``key`` (its registry name), made and filled when new."""
        member = self.members.get(key)
        if member is None:
            member = self.members[key] = _Member(namespace, self.new_store(pool_name, dict(labels)))
            self._replay(member)
        return member.store

    def relabel(self, key: str, labels: Mapping[str, str]) -> None:
        """The pool's labels changed: objects selecting pools by label are matched again."""
        member = self.members.get(key)
        if member is None or dict(member.store.pool_labels) == dict(labels):
            return
        member.store.pool_labels = dict(labels)
        self._replay(member)

    def detach(self, key: str) -> None:
        self.members.pop(key, None)

    def _replay(self, member: _Member[S]) -> None:
        for (namespace, _), obj in list(self.objects.items()):
            if not namespace or namespace == member.namespace:
                member.store.upsert_object(obj)


class PoolPolicies:
    """Both kinds' fan-outs; ``attach`` gives a pool's director its own stores."""

    def __init__(self, pool_group: str) -> None:
        self.objectives: PolicyFanOut[ObjectiveStore] = PolicyFanOut(
            lambda name, labels: ObjectiveStore(name, pool_group, labels)
        )
        self.rewrites: PolicyFanOut[RewriteStore] = PolicyFanOut(
            lambda name, labels: RewriteStore(name, pool_group, labels)
        )

    def attach(self, key: str, pool: Mapping[str, Any], director: Any) -> None:
        """The pool ``key`` (``pool``: its InferencePool object) serves: its director reads its stores."""
        meta = pool.get("metadata") or {}
        labels = meta.get("labels") or {}
        namespace, name = meta.get("namespace") or "", meta.get("name") or key
        director.objectives = self.objectives.attach(key, namespace, name, labels)
        director.rewrites = self.rewrites.attach(key, namespace, name, labels)

    def pool_changed(self, key: str, pool: Mapping[str, Any]) -> None:
        labels = (pool.get("metadata") or {}).get("labels") or {}
        self.objectives.relabel(key, labels)
        self.rewrites.relabel(key, labels)

    def detach(self, key: str) -> None:
        self.objectives.detach(key)
        self.rewrites.detach(key)
