"""The Envoy subset hint: the endpoints the EPP may pick from.

Read from ``filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from epp.framework.endpoint import Endpoint
from epp.framework.wire import SUBSET_KEY, SUBSET_NAMESPACE


def subset_entries(metadata: dict[str, dict[str, Any]]) -> list[str] | None:
    """The hinted entries, or ``None`` when there is no hint (all endpoints are candidates)."""
    ns = metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns:
        return None
    value = ns[SUBSET_KEY]
    if isinstance(value, str):
        items: Iterable[Any] = value.split(",")
    elif isinstance(value, list | tuple):
        items = value
    else:
        return []
    return [s.strip() for s in items if isinstance(s, str) and s.strip()]


def _split(entry: str) -> tuple[str, int | None]:
    """``ip:port`` / ``[v6]:port`` / bare IP -> (ip, port or None)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, int(port) if port.isdigit() else None
    return entry, None  # bare IPv4, or bare IPv6 without brackets


def filter_by_subset(endpoints: Sequence[Endpoint], entries: list[str]) -> list[Endpoint]:
    """The endpoints the hint allows: ``ip:port`` entries match that endpoint, bare IPs every port."""
    exact: set[tuple[str, int]] = set()
    hosts: set[str] = set()
    for entry in entries:
        host, port = _split(entry)
        if port is None:
            hosts.add(host)
        else:
            exact.add((host, port))
    return [
        e for e in endpoints if e.metadata.address in hosts or (e.metadata.address, e.metadata.port) in exact
    ]
