"""The server side of one open watch: the events the store hands it, filtered like the API server does."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from ._resources import ResourceType
from ._selectors import FieldSelector, LabelSelector


@dataclass(frozen=True)
class StoredEvent:
    """One change in the event history. ``obj`` and ``prev`` are never mutated after storing."""

    rv: int
    type: str  # ADDED, MODIFIED or DELETED
    resource: ResourceType
    obj: dict[str, Any]
    #: The state before this change (``None`` for ADDED); filtered watches need it for transitions.
    prev: dict[str, Any] | None


class Watcher:
    """A subscription to one resource type, optionally one namespace and label/field selectors.

    The store appends events to :attr:`pending` under its lock (from any thread) and wakes the watch
    handler on :attr:`loop`; the handler drains :attr:`pending` and translates each event with
    :meth:`translate`.
    """

    def __init__(
        self,
        resource: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.BaseTransport | None = None,
    ) -> None:
        self.resource = resource
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.loop = loop
        self.transport = transport
        self.pending: deque[StoredEvent] = deque()
        self.wakeup = asyncio.Event()
        #: Events at or below this resourceVersion are not for this watch (it started after them).
        self.after_rv = 0
        #: ``None`` while open; ``"abort"`` (break the connection) or ``"end"`` (finish cleanly).
        self.closed: str | None = None

    def matches(self, obj: dict[str, Any]) -> bool:
        """Whether ``obj`` is in this watch's namespace and selected by its selectors."""
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def translate(self, event: StoredEvent) -> tuple[str, dict[str, Any]] | None:
        """The event this watch sends for ``event``, or ``None``.

        As the API server does for filtered watches: a modification that makes an object match is
        sent as ADDED, one that makes it stop matching as DELETED (carrying the new state).
        """
        if event.rv <= self.after_rv:
            return None
        now = self.matches(event.obj)
        if event.type != "MODIFIED":
            return (event.type, event.obj) if now else None
        before = event.prev is not None and self.matches(event.prev)
        if now and before:
            return "MODIFIED", event.obj
        if now:
            return "ADDED", event.obj
        if before:
            return "DELETED", event.obj
        return None

    def push(self, event: StoredEvent) -> None:
        """Queue ``event`` and wake the handler (call with the store lock held; any thread)."""
        self.pending.append(event)
        self.loop.call_soon_threadsafe(self.wakeup.set)

    def close(self, mode: str) -> None:
        """End the watch (on :attr:`loop`): ``"abort"`` breaks the connection, ``"end"`` finishes it."""
        self.closed = mode
        if mode == "abort" and self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]
        self.wakeup.set()
