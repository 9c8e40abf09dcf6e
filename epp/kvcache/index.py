"""The KV-block index: which endpoints hold which request blocks, and in which tier.

Request key (an int, see ``block_keys``) → one int mask with ``NT`` bits per endpoint slot (one per
tier: the configured ones, ``other`` for unknown media, ``speculative``). Masks are interned, so a
key costs its dict entry and its int. Per endpoint an engine-key → request-key map resolves
BlockRemoved (engine hashes only) and a BlockStored's parent. Bounded: ``size`` keys (two
generations: the keys stored least recently go first), ``pod_cache_size`` endpoints per key (the one
that stored least recently is dropped); an endpoint whose engine-key map would outgrow ``size`` is
cleared first. One writer at a time (a lock); ``match`` reads without it.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_POD_CACHE_SIZE",
    "DEFAULT_SIZE",
    "DEFAULT_TIER",
    "DEFAULT_TIER_WEIGHTS",
    "MEDIUM_ALIASES",
    "OTHER_TIER",
    "SPECULATIVE_TIER",
    "IndexStats",
    "KVBlockIndex",
    "PodMatch",
]

DEFAULT_SIZE = 100_000_000
DEFAULT_POD_CACHE_SIZE = 10
DEFAULT_TIER = "gpu"
DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "disk": 0.5, "external": 0.4}
"""Tiers and weights used where the configuration names none (engine media, lower case)."""
MEDIUM_ALIASES = {"cpu_pinned": "cpu", "storage": "disk"}
"""Engine media that are another name of a tier (SGLang's host memory; vLLM's storage tier),
unless the configuration names them."""
OTHER_TIER = "other"
SPECULATIVE_TIER = "speculative"
_INTERN_MAX = 1 << 16
_INT_BYTES = sys.getsizeof(1 << 63)


@dataclass(slots=True)
class PodMatch:
    """One endpoint's match: leading blocks held in any tier, the tier-weighted sum over them (per
    block the best tier's weight), and per tier the leading blocks held in that tier."""

    blocks: int
    score: float
    tiers: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class IndexStats:
    keys: int
    pods: int
    engine_keys: int
    speculative: int
    bytes: int


class _Pod:
    __slots__ = ("emap", "key", "last_store", "slot")

    def __init__(self, key: str, slot: int) -> None:
        self.key = key
        self.slot = slot
        self.emap: dict[int, int | tuple[int, ...]] = {}
        self.last_store = 0


class KVBlockIndex:
    """See the module docstring. ``tier_weights``: tier name (lower case) → scoring weight, over
    ``DEFAULT_TIER_WEIGHTS``; other media (``other``) weigh 1.0."""

    def __init__(
        self,
        size: int = DEFAULT_SIZE,
        pod_cache_size: int = DEFAULT_POD_CACHE_SIZE,
        tier_weights: Mapping[str, float] | None = None,
    ) -> None:
        if size <= 0 or pod_cache_size <= 0:
            raise ValueError("size and pod_cache_size must be > 0")
        self.size = size
        self.pod_cache_size = pod_cache_size
        configured = {k.lower(): float(v) for k, v in (tier_weights or {}).items()}
        weights = DEFAULT_TIER_WEIGHTS | configured
        names = [DEFAULT_TIER, "cpu", *configured, *DEFAULT_TIER_WEIGHTS]
        names = [n for n in dict.fromkeys(names) if n not in (OTHER_TIER, SPECULATIVE_TIER)]
        self.tier_names: tuple[str, ...] = (*names, OTHER_TIER, SPECULATIVE_TIER)
        self._tier_of = {n: i for i, n in enumerate(self.tier_names)}
        self._weights = tuple(weights.get(n, 1.0) for n in self.tier_names)
        self._nt = len(self.tier_names)
        self._spec_tier = self._nt - 1
        self._full = (1 << self._nt) - 1
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._pods: dict[str, _Pod] = {}
        self._slot_pods: list[_Pod | None] = []
        self._free: list[int] = []
        self._low = 0
        self._low_slots = 0
        self._intern: dict[int, int] = {}
        self._spec: deque[tuple[float, _Pod, Sequence[int]]] = deque()
        self._tick = 0
        self._lock = threading.Lock()
        self.admissions = 0
        self.evictions = 0
        self.lookups = 0
        self.lookup_hits = 0

    # --- tiers and slots ----------------------------------------------------------------------

    def tier(self, medium: str | None) -> int:
        """The tier index of an event's ``medium`` (None or "" = GPU; unknown = ``other``)."""
        if not medium:
            return 0
        name = medium.lower()
        t = self._tier_of.get(name)
        if t is None:
            alias = MEDIUM_ALIASES.get(name)
            t = self._tier_of.get(alias) if alias else None
        return self._nt - 2 if t is None or t == self._spec_tier else t

    def _pod(self, key: str) -> _Pod:
        pod = self._pods.get(key)
        if pod is None:
            if self._free:
                slot = min(self._free)
                self._free.remove(slot)
            else:
                slot = len(self._slot_pods)
                self._slot_pods.append(None)
            pod = _Pod(key, slot)
            self._slot_pods[slot] = pod
            self._pods[key] = pod
            if len(self._slot_pods) > self._low_slots:
                n = max(8, 2 * len(self._slot_pods))
                self._low = sum(1 << (s * self._nt) for s in range(n))
                self._low_slots = n
        return pod

    def _any(self, mask: int) -> int:
        """The slot positions (bit ``slot * NT``) of the endpoints holding ``mask`` in any tier."""
        x = mask
        for t in range(1, self._nt):
            x |= mask >> t
        return x & self._low

    def _set(self, d: dict[int, int], key: int, value: int) -> None:
        if value:
            interned = self._intern.get(value)
            if interned is None:
                if len(self._intern) >= _INTERN_MAX:
                    self._intern.clear()
                interned = self._intern[value] = value
            d[key] = interned
        else:
            d.pop(key, None)

    # --- writes (one writer at a time) --------------------------------------------------------

    def _add_bits(self, pod: _Pod, rk: int, tier: int) -> bool:
        """Set ``pod``'s ``tier`` bit on ``rk``; True when the bit was already set."""
        nt, slot = self._nt, pod.slot
        young = self._young
        v = young.get(rk)
        if v is None:
            v = self._old.pop(rk, None)
            if v is None:
                v = 0
                if len(young) + len(self._old) >= self.size:
                    self._evict_one()
                    young = self._young
        bit = 1 << (slot * nt + tier)
        if v & bit:
            young[rk] = v
            return True
        shift = slot * nt
        if not (v >> shift) & self._full:
            held = self._any(v)
            if held.bit_count() >= self.pod_cache_size:
                v = self._drop_oldest(v, held)
        nv = v | bit
        if tier != self._spec_tier:
            nv &= ~(1 << (shift + self._spec_tier))
        self.admissions += 1
        self._set(young, rk, nv)
        return False

    def _drop_oldest(self, v: int, held: int) -> int:
        nt = self._nt
        victim: _Pod | None = None
        x = held
        while x:
            low = x & -x
            x ^= low
            p = self._slot_pods[(low.bit_length() - 1) // nt]
            if p is not None and (victim is None or p.last_store < victim.last_store):
                victim = p
        if victim is None:
            return v
        self.evictions += 1
        return v & ~(self._full << (victim.slot * nt))

    def _evict_one(self) -> None:
        if not self._old:
            self._old = self._young  # readers see the key in one of the two during the swap
            self._young = {}
        if self._old:
            self._old.popitem()
            self.evictions += 1

    def _clear_bits(self, rk: int, clear: int) -> int:
        """Clear ``clear`` on ``rk``; the remaining mask (0 = the key is gone)."""
        d = self._young
        v = d.get(rk)
        if v is None:
            d = self._old
            v = d.get(rk)
            if v is None:
                return 0
        nv = v & ~clear
        if nv != v:
            self.evictions += 1
            self._set(d, rk, nv)
        return nv

    def _mask_of(self, rk: int) -> int:
        v = self._young.get(rk)
        return v if v is not None else self._old.get(rk, 0)

    def store(
        self, pod_key: str, engine_keys: Sequence[int], request_keys: Sequence[int], tier: int = 0
    ) -> None:
        """A BlockStored: ``request_keys`` held by the endpoint in ``tier``; engine keys map onto
        request keys by their ratio (1:1, many:1 or 1:many, as the reference). A block already held
        in ``tier`` stays one copy (a re-announcement), so one removal drops it."""
        if not request_keys:
            return
        with self._lock:
            pod = self._pod(pod_key)
            self._tick += 1
            pod.last_store = self._tick
            for rk in request_keys:
                self._add_bits(pod, rk, tier)
            ne, nr = len(engine_keys), len(request_keys)
            if ne == 0:
                return
            emap = pod.emap
            if len(emap) + ne > self.size:  # removals were lost on a massive scale: start over
                self._clear_locked(pod)
                for rk in request_keys:
                    self._add_bits(pod, rk, tier)
            if ne == nr:
                emap.update(zip(engine_keys, request_keys, strict=True))
                return
            n = max(ne, nr)
            grouped: dict[int, list[int]] = {}
            for i in range(n):
                grouped.setdefault(engine_keys[i * ne // n], []).append(request_keys[i * nr // n])
            for ek, rks in grouped.items():
                emap[ek] = rks[0] if len(rks) == 1 else tuple(rks)

    def store_tier(self, pod_key: str, engine_keys: Sequence[int], tier: int) -> bool:
        """A location-only BlockStored (no tokens, e.g. an offload to CPU): the blocks the endpoint
        already holds under these engine keys are now also in ``tier``. False when none resolved."""
        with self._lock:
            pod = self._pods.get(pod_key)
            if pod is None:
                return False
            resolved: list[int] = []
            for ek in engine_keys:
                rks = pod.emap.get(ek)
                if rks is None:
                    continue
                if isinstance(rks, int):
                    resolved.append(rks)
                else:
                    resolved.extend(rks)
            if not resolved:
                return False
            self._tick += 1
            pod.last_store = self._tick
            for rk in dict.fromkeys(resolved):
                self._add_bits(pod, rk, tier)
            return True

    def remove(self, pod_key: str, engine_keys: Iterable[int], tier: int = 0) -> int:
        """A BlockRemoved; returns the number of hashes forwarded to eviction."""
        forwarded = 0
        with self._lock:
            pod = self._pods.get(pod_key)
            if pod is None:
                return 0
            shift = pod.slot * self._nt
            bit = 1 << (shift + tier)
            full = self._full << shift
            for ek in engine_keys:
                forwarded += 1
                rks = pod.emap.get(ek)
                if rks is None:
                    continue
                if isinstance(rks, int):
                    rks = (rks,)
                held = False
                for rk in rks:
                    if self._clear_bits(rk, bit) & full:
                        held = True
                if not held:
                    del pod.emap[ek]
        return forwarded

    def request_key(self, pod_key: str, engine_key: int) -> int | None:
        """The (last) request key the endpoint's ``engine_key`` maps to (parent resolution)."""
        pod = self._pods.get(pod_key)
        if pod is None:
            return None
        rks = pod.emap.get(engine_key)
        if rks is None:
            return None
        return rks if isinstance(rks, int) else rks[-1]

    def add_speculative(self, pod_key: str, request_keys: Sequence[int], expires_at: float) -> None:
        """Predicted entries for an endpoint just picked, dropped at ``expires_at`` (a monotonic
        time, non-decreasing across calls) unless an event confirmed them first."""
        if not request_keys:
            return
        with self._lock:
            pod = self._pod(pod_key)
            for rk in request_keys:
                self._add_bits(pod, rk, self._spec_tier)
            self._spec.append((expires_at, pod, request_keys))

    def expire(self, now: float) -> int:
        """Drop speculative entries whose time has come; how many batches were dropped."""
        spec = self._spec
        if not spec or spec[0][0] > now:
            return 0
        n = 0
        with self._lock:
            while spec and spec[0][0] <= now:
                _, pod, keys = spec.popleft()
                n += 1
                if self._pods.get(pod.key) is not pod:
                    continue
                bit = 1 << (pod.slot * self._nt + self._spec_tier)
                for rk in keys:
                    self._clear_bits(rk, bit)
        return n

    def clear_pod(self, pod_key: str) -> None:
        """Forget everything the endpoint holds (restart, lost events, AllBlocksCleared)."""
        with self._lock:
            pod = self._pods.get(pod_key)
            if pod is not None:
                self._clear_locked(pod)

    def _clear_locked(self, pod: _Pod) -> None:
        full = self._full << (pod.slot * self._nt)
        for rks in pod.emap.values():
            if isinstance(rks, int):
                self._clear_bits(rks, full)
            else:
                for rk in rks:
                    self._clear_bits(rk, full)
        for _, p, keys in self._spec:
            if p is pod:
                for rk in keys:
                    self._clear_bits(rk, full)
        pod.emap.clear()

    def remove_pod(self, pod_key: str) -> None:
        """The endpoint left: clear it and release its slot."""
        with self._lock:
            pod = self._pods.pop(pod_key, None)
            if pod is None:
                return
            self._clear_locked(pod)
            self._slot_pods[pod.slot] = None
            self._free.append(pod.slot)

    def clear(self) -> None:
        with self._lock:
            self._young = {}
            self._old = {}
            for pod in self._pods.values():
                pod.emap.clear()
            self._spec.clear()

    # --- reads (lock-free) --------------------------------------------------------------------

    def holds(self, request_key: int, pod_key: str) -> tuple[str, ...]:
        """The tiers in which the endpoint holds ``request_key`` (tests, debugging)."""
        pod = self._pods.get(pod_key)
        if pod is None:
            return ()
        bits = (self._mask_of(request_key) >> (pod.slot * self._nt)) & self._full
        return tuple(n for i, n in enumerate(self.tier_names) if bits >> i & 1)

    def match(self, request_keys: Sequence[int], pods: Iterable[str]) -> dict[str, PodMatch]:
        """Per endpoint among ``pods`` holding the first block: its contiguous match.

        O(blocks) per request plus O(endpoints) per change of the set of holders along the prompt;
        no endpoint holding the first block returns at once.
        """
        self.lookups += 1
        n = len(request_keys)
        if n == 0:
            return {}
        gy, go = self._young.get, self._old.get
        k = request_keys[0]
        v = gy(k)
        if v is None:
            v = go(k, 0)
        if not v:
            return {}
        nt, full, table = self._nt, self._full, self._pods
        cand = 0
        for key in pods:
            p = table.get(key)
            if p is not None:
                cand |= full << (p.slot * nt)
        v &= cand
        if not v:
            return {}
        any_ = self._any
        alive = any_(v)
        alive_full = alive * full
        tier_alive = v
        blocks: dict[int, int] = {}
        tiers: dict[int, int] = {}
        scores: dict[int, float] = {}
        last = v
        raw_last = -1  # the unmasked (interned) value of the previous block: same object, same run
        run_start = 0
        end = n
        for i in range(1, n):
            k = request_keys[i]
            x = gy(k)
            if x is None:
                x = go(k, 0)
            if x is raw_last:
                continue
            raw_last = x
            x &= alive_full
            if x == last:
                continue
            self._score_run(scores, last, i - run_start)
            if not x:
                end = i
                break
            now_alive = any_(x)
            self._record(blocks, alive & ~now_alive, i)
            alive, alive_full = now_alive, now_alive * full
            nta = tier_alive & x
            self._record(tiers, tier_alive & ~nta, i)
            tier_alive = nta
            last = x
            run_start = i
        else:
            self._score_run(scores, last, n - run_start)
        self._record(blocks, alive, end)
        self._record(tiers, tier_alive, end)
        slot_pods = self._slot_pods
        names = self.tier_names
        out: dict[str, PodMatch] = {}
        for bitpos, count in blocks.items():
            slot = bitpos // nt
            p = slot_pods[slot] if slot < len(slot_pods) else None
            if p is not None:
                out[p.key] = PodMatch(count, scores.get(slot, 0.0))
        for bitpos, count in tiers.items():
            slot, t = divmod(bitpos, nt)
            p = slot_pods[slot] if slot < len(slot_pods) else None
            m = out.get(p.key) if p is not None else None
            if m is not None:
                m.tiers[names[t]] = count
        if out:
            self.lookup_hits += max(m.blocks for m in out.values())
        return out

    @staticmethod
    def _record(into: dict[int, int], bits: int, count: int) -> None:
        while bits:
            low = bits & -bits
            bits ^= low
            into[low.bit_length() - 1] = count

    def _score_run(self, scores: dict[int, float], mask: int, length: int) -> None:
        nt, weights = self._nt, self._weights
        best: dict[int, float] = {}
        x = mask
        while x:
            low = x & -x
            x ^= low
            slot, t = divmod(low.bit_length() - 1, nt)
            w = weights[t]
            if w > best.get(slot, -1.0):
                best[slot] = w
        for slot, w in best.items():
            scores[slot] = scores.get(slot, 0.0) + w * length

    # --- introspection ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def pod_keys(self) -> list[str]:
        return list(self._pods)

    def stats(self) -> IndexStats:
        """Sizes and an estimate of the bytes held (dicts, key ints, engine maps)."""
        keys = len(self)
        engine = 0
        nbytes = sys.getsizeof(self._young) + sys.getsizeof(self._old) + keys * _INT_BYTES
        for pod in list(self._pods.values()):
            emap = pod.emap
            engine += len(emap)
            nbytes += sys.getsizeof(emap) + len(emap) * _INT_BYTES
        spec = sum(len(k) for _, _, k in list(self._spec))
        return IndexStats(keys=keys, pods=len(self._pods), engine_keys=engine, speculative=spec, bytes=nbytes)
