"""The approximate prefix index: which endpoints are believed to hold which prompt blocks."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["PrefixIndex"]


class _EndpointLRU:
    """One endpoint's block hashes, least recently used first."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, None] = OrderedDict()


class PrefixIndex:
    """``hash -> endpoint keys`` plus one LRU of hashes per endpoint, whose capacity is fixed at creation.

    Evicting a hash from an endpoint's LRU removes that endpoint from the hash's holders; a hash
    without holders leaves the map, so memory is bounded by the sum of the capacities. A hash held by
    one endpoint (the common case) maps to the endpoint's key string itself; only shared hashes get a
    ``frozenset``, replaced (never changed) when a holder joins or leaves, so a match may keep the
    sets it read. ``add`` inserts a prompt tail first, so under eviction pressure the tail of a
    prompt goes before its head. Not thread-safe: used from the event loop only.
    """

    __slots__ = ("__weakref__", "_holders", "_lrus", "_size")

    def __init__(self) -> None:
        # hash -> the single holder's key, or a frozenset of keys when several endpoints hold it
        self._holders: dict[int, str | frozenset[str]] = {}
        self._lrus: dict[str, _EndpointLRU] = {}
        self._size = 0

    # --- reads ------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per endpoint key, how many of ``hashes`` it holds, walking until the first unheld hash.

        The reference walks the hashes, adds 1 to every endpoint in each block's holder set and stops
        at the first block nobody holds: O(Σ holders) Python steps, i.e. blocks * endpoints when a
        system prompt is cached everywhere. Here one C-level pass collects the holder sets, then the
        walk goes backwards: an endpoint first met at block i gets i + 1, a block's holders are only
        examined when there are more of them than endpoints seen so far, and the walk stops once every
        holder of the first block is placed (at once when one endpoint holds the whole chain). That is
        at most O(blocks + endpoints) Python steps, and equal to the reference's count because holder sets
        along a chain are nested (``S_0 ⊇ S_1 ⊇ ...``): ``add`` inserts a chain tail first, so an
        endpoint's copy of block j < i is always at least as recent as its copy of block i and the LRU
        evicts block i first.
        """
        walked: list[str | frozenset[str] | None] = list(map(self._holders.get, hashes))  # one C-level pass
        try:
            n = walked.index(None)  # the walk stops at the first block nobody holds
        except ValueError:
            n = len(walked)
        if not n:
            return {}
        first = walked[0]
        everyone = 1 if isinstance(first, str) else len(first or ())  # S_0: every endpoint met
        counts: dict[str, int] = {}
        for i in range(n - 1, -1, -1):
            v = walked[i]
            if isinstance(v, str):
                if v not in counts:
                    counts[v] = i + 1
            elif v is not None and len(v) > len(counts):  # nested: only a bigger set brings new ones
                wider = dict.fromkeys(v, i + 1)  # every holder at this depth, then the deeper ones
                wider.update(counts)
                counts = wider
            if len(counts) >= everyone:  # all of S_0 placed: earlier blocks bring no one new
                break
        return counts

    def match_groups(self, hashes: Sequence[int]) -> list[tuple[int, str | frozenset[str]]]:
        """``match`` as holder groups: ``(count, holders)`` pairs, deepest first, where ``holders``
        (one key, or a frozenset of keys, shared with the index and never changed) hold the first
        ``count`` hashes; each pair's holders include the deeper pairs' (the sets along a chain are
        nested, see ``match``). An endpoint's count in ``match`` is that of the deepest pair holding
        it. O(blocks) Python steps at most, none per endpoint."""
        walked = list(map(self._holders.get, hashes))
        try:
            n = walked.index(None)
        except ValueError:
            n = len(walked)
        if not n:
            return []
        first = walked[0]
        everyone = 1 if isinstance(first, str) else len(first or ())
        groups: list[tuple[int, str | frozenset[str]]] = []
        seen = 0
        for i in range(n - 1, -1, -1):
            v = walked[i]
            size = 1 if isinstance(v, str) else len(v or ())
            if size > seen:
                assert v is not None
                groups.append((i + 1, v))
                seen = size
                if size >= everyone:
                    break
        return groups

    def holders(self, h: int) -> frozenset[str]:
        """The endpoint keys holding block hash ``h`` (empty when none)."""
        v = self._holders.get(h)
        if v is None:
            return frozenset()
        if isinstance(v, str):
            return frozenset((v,))
        return v

    def size(self) -> int:
        """Total entries over all endpoints' LRUs."""
        return self._size

    def hash_count(self) -> int:
        """Distinct block hashes currently held by at least one endpoint."""
        return len(self._holders)

    def endpoint_keys(self) -> list[str]:
        return list(self._lrus)

    def entries(self, key: str) -> int:
        """How many hashes the endpoint ``key`` holds (0 when unknown)."""
        lru = self._lrus.get(key)
        return len(lru.entries) if lru is not None else 0

    def export(self, chunk: int = 8192) -> Iterator[tuple[list[int], str, int]]:
        """The whole index as ``add`` arguments that rebuild it in an empty index, LRU order
        included: per endpoint, its hashes oldest first in chunks of ``chunk``, each chunk newest
        first (``add`` inserts last to first)."""
        for key, lru in list(self._lrus.items()):  # the caller may interleave adds between chunks
            hashes = list(lru.entries)
            for i in range(0, len(hashes), chunk):
                yield hashes[i : i + chunk][::-1], key, lru.capacity

    def capacity(self, key: str) -> int | None:
        """The fixed LRU capacity of endpoint ``key``, or None when it has no LRU yet."""
        lru = self._lrus.get(key)
        return lru.capacity if lru is not None else None

    # --- writes -----------------------------------------------------------------------------

    def add(self, hashes: Sequence[int], key: str, capacity: int) -> None:
        """Record that endpoint ``key`` now holds ``hashes`` (a prompt's chained block hashes).

        ``capacity`` only matters when the endpoint has no LRU yet: it is fixed at creation.
        Hashes are inserted last to first, so the first blocks are the most recently used.
        """
        lru = self._lrus.get(key)
        if lru is None:
            lru = self._lrus[key] = _EndpointLRU(max(1, capacity))
        entries = lru.entries
        if all(map(entries.__contains__, hashes)):  # a conversation's next turn: only refresh them
            deque(map(entries.move_to_end, reversed(hashes)), maxlen=0)  # C-level, tail first
            return
        cap = lru.capacity
        holders = self._holders
        added = 0
        for h in reversed(hashes):
            if h in entries:
                entries.move_to_end(h)
                continue
            entries[h] = None
            added += 1
            v = holders.get(h)
            if v is None:
                holders[h] = key
            elif isinstance(v, str):
                if v != key:
                    holders[h] = frozenset((v, key))
            elif key not in v:
                holders[h] = v | {key}
            if len(entries) > cap:
                evicted, _ = entries.popitem(last=False)
                self._unlink(evicted, key)
                added -= 1
        self._size += added

    def clear(self) -> None:
        self._holders.clear()
        self._lrus.clear()
        self._size = 0

    def remove_endpoint(self, key: str) -> int:
        """Forget everything endpoint ``key`` holds; returns the number of entries dropped."""
        lru = self._lrus.pop(key, None)
        if lru is None:
            return 0
        for h in lru.entries:
            self._unlink(h, key)
        n = len(lru.entries)
        self._size -= n
        return n

    def retain(self, live_keys: Iterable[str]) -> list[str]:
        """Drop every endpoint not in ``live_keys``; returns the keys dropped."""
        live = live_keys if isinstance(live_keys, set | frozenset) else set(live_keys)
        gone = [k for k in self._lrus if k not in live]
        for k in gone:
            self.remove_endpoint(k)
        return gone

    def _unlink(self, h: int, key: str) -> None:
        holders = self._holders
        v = holders.get(h)
        if v is None:
            return
        if isinstance(v, str):
            if v == key:
                del holders[h]
            return
        if key not in v:
            return
        rest = v - {key}
        if len(rest) == 1:
            holders[h] = next(iter(rest))
        elif rest:
            holders[h] = rest
        else:
            del holders[h]
