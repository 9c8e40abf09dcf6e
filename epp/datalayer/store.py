"""The endpoint store: the single place discovery writes endpoints to and the scheduler reads from."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from epp.framework.endpoint import Endpoint, EndpointMetadata
from epp.framework.roles import ROLE_BOTH, ROLE_LABEL, ROLE_PREFILL_DECODE

log = structlog.get_logger("epp.store")

Listener = Callable[[Endpoint], None]


def _warn_role_both(metadata: EndpointMetadata) -> None:
    """One warning when an endpoint arrives with (or changes to) the removed role value ``both``."""
    if metadata.labels.get(ROLE_LABEL) == ROLE_BOTH:
        log.warning(
            f"pod label {ROLE_LABEL}: {ROLE_BOTH} is deprecated (removed in router v0.11.0) and read "
            f"as {ROLE_PREFILL_DECODE} (with --compat-version v0.11, as in v0.11, no role filter keeps "
            f"it); label the pod {ROLE_LABEL}: {ROLE_PREFILL_DECODE}",
            endpoint=metadata.key,
        )


class EndpointStore:
    """Endpoints by key, written by one discovery task, read by every request.

    ``endpoints()`` returns a tuple rebuilt on the first read after a change: O(1) per request, and a
    burst of changes costs one rebuild. Listeners are told of additions, in-place updates and removals.
    """

    def __init__(self) -> None:
        self._by_key: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] | None = ()
        self._on_add: list[Listener] = []
        self._on_remove: list[Listener] = []
        self._on_update: list[Listener] = []
        self.synced = False  # set once discovery finished its initial load

    # --- writers (discovery) ---------------------------------------------------------------

    def upsert(self, metadata: EndpointMetadata) -> None:
        current = self._by_key.get(metadata.key)
        if current is not None:
            if current.metadata == metadata:
                return
            if current.metadata.metrics_hostport == metadata.metrics_hostport:
                if current.metadata.labels.get(ROLE_LABEL) != ROLE_BOTH:
                    _warn_role_both(metadata)
                current.metadata = metadata  # labels or names changed: keep metrics and counters
                self._snapshot = None
                for listener in self._on_update:
                    listener(current)
                return
            self.delete(metadata.key)  # the address changed: it is a different server
        endpoint = Endpoint(metadata=metadata)
        _warn_role_both(metadata)
        self._by_key[metadata.key] = endpoint
        self._snapshot = None
        log.info("endpoint added", endpoint=metadata.key, address=metadata.hostport)
        for listener in self._on_add:
            listener(endpoint)

    def delete(self, key: str) -> None:
        endpoint = self._by_key.pop(key, None)
        if endpoint is None:
            return
        self._snapshot = None
        log.info("endpoint removed", endpoint=key, address=endpoint.hostport)
        for listener in self._on_remove:
            listener(endpoint)

    def keys(self) -> frozenset[str]:
        return frozenset(self._by_key)

    # --- readers ---------------------------------------------------------------------------

    def endpoints(self) -> tuple[Endpoint, ...]:
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = self._snapshot = tuple(self._by_key.values())
        return snapshot

    def get(self, key: str) -> Endpoint | None:
        return self._by_key.get(key)

    def __len__(self) -> int:
        return len(self._by_key)

    # --- listeners ---------------------------------------------------------------------------

    def subscribe(
        self,
        on_add: Listener | None = None,
        on_remove: Listener | None = None,
        on_update: Listener | None = None,
    ) -> None:
        """Register listeners; ``on_add`` is called at once for endpoints already present.
        ``on_update``: an endpoint's metadata changed in place (labels, names; same address)."""
        if on_add is not None:
            self._on_add.append(on_add)
            for endpoint in self.endpoints():
                on_add(endpoint)
        if on_remove is not None:
            self._on_remove.append(on_remove)
        if on_update is not None:
            self._on_update.append(on_update)
