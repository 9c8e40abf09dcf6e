"""The object store: objects by resource type, one global resourceVersion, a bounded event history.

Every method is thread-safe (one re-entrant lock); the watch handlers on the server loop and the
test thread's synchronous helpers share it. Stored objects and history entries are never mutated:
every write stores a fresh copy and readers get copies.
"""

from __future__ import annotations

import copy
import datetime
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ._resources import ResourceType
from ._status import ApiError
from ._watcher import StoredEvent, Watcher

Key = tuple[str, str]  # (namespace, name)
Obj = dict[str, Any]

#: The resourceVersion of an empty store; the first write gets the next one.
INITIAL_RESOURCE_VERSION = 100
#: How many events the history keeps (like etcd before compaction).
HISTORY_LIMIT = 10_000


def now_rfc3339() -> str:
    """The current time as Kubernetes serialises timestamps (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "default", meta.get("name") or ""


def _without_meta_and_status(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _sans_rv(obj: Obj) -> Obj:
    out = dict(obj)
    out["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"}
    return out


def expired(rv: int, oldest: int, what: str = "too old resource version") -> ApiError:
    """The 410 Expired error for a resourceVersion the history no longer covers."""
    return ApiError(410, f"{what}: {rv} ({oldest + 1})", reason="Expired")


class ObjectStore:
    """Objects of every served resource type, with etcd-like resourceVersions and history."""

    def __init__(self, history_limit: int = HISTORY_LIMIT) -> None:
        self.lock = threading.RLock()
        self.rv = INITIAL_RESOURCE_VERSION
        #: Every event with a resourceVersion above this is still in the history.
        self.compacted_rv = INITIAL_RESOURCE_VERSION
        self._history_limit = history_limit
        self._history: deque[StoredEvent] = deque()
        self._objects: dict[ResourceType, dict[Key, Obj]] = {}
        self._watchers: set[Watcher] = set()

    # ----------------------------------------------------------------------------------------- reads

    def get(self, resource: ResourceType, namespace: str, name: str) -> Obj | None:
        """A copy of one object, or ``None``."""
        with self.lock:
            obj = self._objects.get(resource, {}).get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, resource: ResourceType, namespace: str | None) -> list[Obj]:
        """Copies of the objects (of one namespace, or all), in etcd key order (namespace, name)."""
        with self.lock:
            return self._select(self._objects.get(resource, {}), namespace)

    def snapshot(self, resource: ResourceType, namespace: str | None, rv: int) -> list[Obj]:
        """The objects as they were at ``rv`` (410 Expired if the history no longer reaches back)."""
        with self.lock:
            if rv < self.compacted_rv:
                raise expired(rv, self.compacted_rv)
            objects = dict(self._objects.get(resource, {}))
            for event in reversed(self._history):
                if event.rv <= rv:
                    break
                if event.resource != resource:
                    continue
                if event.type == "ADDED":
                    objects.pop(_key(event.obj), None)
                else:
                    assert event.prev is not None
                    objects[_key(event.prev)] = event.prev
            return self._select(objects, namespace)

    @staticmethod
    def _select(objects: dict[Key, Obj], namespace: str | None) -> list[Obj]:
        keys = sorted(k for k in objects if namespace is None or k[0] == namespace)
        return [copy.deepcopy(objects[k]) for k in keys]

    # ---------------------------------------------------------------------------------------- writes

    def create(self, resource: ResourceType, obj: Obj) -> Obj:
        """Store a new object; 409 AlreadyExists if its name is taken. Fills the server-set metadata."""
        obj = copy.deepcopy(obj)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        with self.lock:
            objects = self._objects.setdefault(resource, {})
            key = _key(obj)
            if key in objects:
                raise ApiError(
                    409,
                    f'{resource.qualified_resource} "{key[1]}" already exists',
                    reason="AlreadyExists",
                    details={"name": key[1], "group": resource.group, "kind": resource.plural},
                )
            self.rv += 1
            meta.update(
                uid=str(uuid.uuid4()),
                resourceVersion=str(self.rv),
                creationTimestamp=now_rfc3339(),
                generation=1,
            )
            objects[key] = obj
            self._emit("ADDED", resource, obj, None)
            return copy.deepcopy(obj)

    def require(self, resource: ResourceType, namespace: str, name: str) -> Obj:
        """A copy of one object; 404 NotFound if missing."""
        obj = self.get(resource, namespace, name)
        if obj is None:
            raise ApiError.not_found(resource.qualified_resource, name, resource.group, resource.plural)
        return obj

    def update(
        self,
        resource: ResourceType,
        obj: Obj,
        *,
        expect_rv: str | None = None,
        keep_status: bool = False,
        status_only: bool = False,
        force: bool = False,
    ) -> Obj:
        """Replace a stored object (404 if missing; 409 Conflict if ``expect_rv`` is stale).

        ``keep_status`` keeps the stored ``status`` (a write to a resource with a status subresource);
        ``status_only`` takes only ``status`` from ``obj``. An update that changes nothing is a no-op
        (no new resourceVersion, no event) unless ``force``. ``generation`` grows when anything but
        metadata and status changes.
        """
        namespace, name = _key(obj)
        with self.lock:
            objects = self._objects.setdefault(resource, {})
            current = objects.get((namespace, name))
            if current is None:
                raise ApiError.not_found(resource.qualified_resource, name, resource.group, resource.plural)
            cur_meta = current["metadata"]
            if expect_rv and expect_rv != cur_meta["resourceVersion"]:
                raise ApiError(
                    409,
                    f'Operation cannot be fulfilled on {resource.qualified_resource} "{name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                    reason="Conflict",
                    details={"name": name, "group": resource.group, "kind": resource.plural},
                )
            if status_only:
                new = copy.deepcopy(current)
                if "status" in obj:
                    new["status"] = copy.deepcopy(obj["status"])
                else:
                    new.pop("status", None)
            else:
                new = copy.deepcopy(obj)
                if keep_status:
                    new.pop("status", None)
                    if "status" in current:
                        new["status"] = copy.deepcopy(current["status"])
            new["apiVersion"], new["kind"] = resource.api_version, resource.kind
            meta = new.setdefault("metadata", {})
            for field in ("uid", "creationTimestamp", "namespace", "name", "generation", "resourceVersion"):
                meta[field] = cur_meta[field]
            if _without_meta_and_status(new) != _without_meta_and_status(current):
                meta["generation"] = cur_meta["generation"] + 1
            if not force and _sans_rv(new) == _sans_rv(current):
                return copy.deepcopy(current)
            self.rv += 1
            meta["resourceVersion"] = str(self.rv)
            objects[(namespace, name)] = new
            self._emit("MODIFIED", resource, new, current)
            return copy.deepcopy(new)

    def delete(
        self, resource: ResourceType, namespace: str, name: str, preconditions: dict[str, Any] | None = None
    ) -> Obj:
        """Remove an object (404 if missing, 409 if ``preconditions`` uid/resourceVersion fail)."""
        with self.lock:
            objects = self._objects.setdefault(resource, {})
            current = objects.get((namespace, name))
            if current is None:
                raise ApiError.not_found(resource.qualified_resource, name, resource.group, resource.plural)
            for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                wanted = (preconditions or {}).get(field)
                if wanted and wanted != current["metadata"][field]:
                    raise ApiError(
                        409,
                        f"Precondition failed: {label} in precondition: {wanted}, {label} in object meta: "
                        f"{current['metadata'][field]}",
                        reason="Conflict",
                    )
            del objects[(namespace, name)]
            self.rv += 1
            last = copy.deepcopy(current)
            last["metadata"]["resourceVersion"] = str(self.rv)
            self._emit("DELETED", resource, last, current)
            return copy.deepcopy(last)

    def compact(self) -> None:
        """Forget the whole event history: older resourceVersions now get 410 Expired."""
        with self.lock:
            self._history.clear()
            self.compacted_rv = self.rv

    def _emit(self, type_: str, resource: ResourceType, obj: Obj, prev: Obj | None) -> None:
        event = StoredEvent(self.rv, type_, resource, obj, prev)
        self._history.append(event)
        while len(self._history) > self._history_limit:
            self.compacted_rv = self._history.popleft().rv
        for watcher in self._watchers:
            if watcher.resource == resource:
                watcher.push(event)

    # --------------------------------------------------------------------------------------- watches

    def open_watch(self, watcher: Watcher, since: int | None) -> tuple[int, list[Obj], list[StoredEvent]]:
        """Register ``watcher`` atomically with what it must send first.

        ``since=None``: the current resourceVersion and matching objects (to send as ADDED), no backlog.
        ``since=N``: every event after N (410 Expired if compacted away), no initial objects.
        """
        with self.lock:
            if since is None:
                initial = [
                    o for o in self.list_objects(watcher.resource, watcher.namespace) if watcher.matches(o)
                ]
                backlog: list[StoredEvent] = []
                watcher.after_rv = self.rv
            else:
                if since < self.compacted_rv:
                    raise expired(since, self.compacted_rv)
                initial = []
                backlog = [e for e in self._history if e.rv > since and e.resource == watcher.resource]
                watcher.after_rv = since
            self._watchers.add(watcher)
            return self.rv, initial, backlog

    def close_watch(self, watcher: Watcher) -> None:
        """Unregister ``watcher`` (idempotent)."""
        with self.lock:
            self._watchers.discard(watcher)

    def bookmark_rv(self, watcher: Watcher) -> int | None:
        """The resourceVersion a bookmark may carry now: the current one once ``watcher`` has no backlog."""
        with self.lock:
            return None if watcher.pending else self.rv

    def watchers(self, predicate: Callable[[Watcher], bool] | None = None) -> list[Watcher]:
        """The open watchers (that satisfy ``predicate``)."""
        with self.lock:
            return [w for w in self._watchers if predicate is None or predicate(w)]

    def close_watches(self, watchers: Iterable[Watcher], mode: str) -> int:
        """Unregister ``watchers`` now and end their streams on their loop (``"abort"`` or ``"end"``)."""
        count = 0
        with self.lock:
            for watcher in watchers:
                if watcher in self._watchers:
                    self._watchers.discard(watcher)
                    watcher.loop.call_soon_threadsafe(watcher.close, mode)
                    count += 1
        return count
