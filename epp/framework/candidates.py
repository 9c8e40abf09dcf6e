"""What a plugin derives from a candidate list once and reuses while the list is the same.

Requests see the same candidates (the store's snapshot, or a filter's stable output) again and
again; comparing a list with the last one is a C-level identity walk, far cheaper than rebuilding
sets and position maps per request.
"""

from __future__ import annotations

import operator
from typing import Any

from epp.framework.endpoint import Endpoint

FRESH_UNTIL_MIN_KEY = "epp.framework.fresh-until-min"
"""Cycle-state entry of ``fresh_until_min``: (the candidate list, the least ``fresh_until``)."""
_FRESH_UNTIL = operator.attrgetter("metrics.fresh_until")


def fresh_until_min(cycle: Any, endpoints: list[Endpoint]) -> float:
    """The least ``metrics.fresh_until`` over ``endpoints`` (inf for none): every candidate's
    metrics are known at ``now`` iff ``now`` is at most this. Computed once per request and list
    (kept in the cycle state), for the metric scorers of one request share it."""
    entry = cycle.get(FRESH_UNTIL_MIN_KEY)
    if entry is not None and entry[0] is endpoints:
        return float(entry[1])
    value = min(map(_FRESH_UNTIL, endpoints), default=float("inf"))
    cycle[FRESH_UNTIL_MIN_KEY] = (endpoints, value)
    return value


class CandidateMemo:
    """The last candidate list given to ``update`` and, built on first use, its member set, the
    position of each endpoint and each key's endpoint. Derived objects are replaced, never
    mutated, so a request may keep the ones it read."""

    __slots__ = ("_by_key", "_endpoints", "_key_positions", "_key_set", "_keys", "_members", "_positions")

    def __init__(self) -> None:
        self._endpoints: list[Endpoint] = []
        self._members: frozenset[Endpoint] | None = None
        self._positions: dict[Endpoint, int] | None = None
        self._by_key: dict[str, Endpoint] | None = None
        self._keys: list[str] | None = None
        self._key_positions: dict[str, int] | None = None
        self._key_set: frozenset[str] | None = None

    def update(self, endpoints: list[Endpoint]) -> bool:
        """Remember ``endpoints``; True when they are the same objects, in order, as last time."""
        if endpoints == self._endpoints:  # Endpoint compares by identity
            return True
        self._endpoints = list(endpoints)
        self._members = self._positions = self._by_key = None
        self._keys = self._key_positions = None
        self._key_set = None
        return False

    @property
    def endpoints(self) -> list[Endpoint]:
        return self._endpoints

    def members(self) -> frozenset[Endpoint]:
        m = self._members
        if m is None:
            m = self._members = frozenset(self._endpoints)
        return m

    def positions(self) -> dict[Endpoint, int]:
        """Endpoint -> its first position in the list."""
        p = self._positions
        if p is None:
            p = dict(zip(reversed(self._endpoints), range(len(self._endpoints) - 1, -1, -1), strict=True))
            self._positions = p
        return p

    def keys(self) -> list[str]:
        """Each endpoint's ``metadata.key``, in order."""
        k = self._keys
        if k is None:
            k = self._keys = [e.metadata.key for e in self._endpoints]
        return k

    def by_key(self) -> dict[str, Endpoint] | None:
        """``metadata.key`` -> endpoint; None when two candidates share a key."""
        b = self._by_key
        if b is None:
            b = {e.metadata.key: e for e in self._endpoints}
            if len(b) != len(self.members()):
                return None
            self._by_key = b
        return b

    def key_positions(self) -> dict[str, int] | None:
        """``metadata.key`` -> its position; None when two candidates share a key."""
        p = self._key_positions
        if p is None:
            keys = self.keys()
            p = dict(zip(keys, range(len(keys)), strict=True))
            if len(p) != len(keys):
                return None
            self._key_positions = p
        return p

    def key_set(self) -> frozenset[str]:
        """The candidates' ``metadata.key`` values."""
        k = self._key_set
        if k is None:
            k = self._key_set = frozenset(self.keys())
        return k
