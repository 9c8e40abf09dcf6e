"""LoRA adapter slots of the simulated engine: GPU slots over a host (CPU) cache, both LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

RESIDENT = "gpu"
"""``LoraSlots.acquire``: the adapter already held a GPU slot (no load)."""
FROM_HOST = "cpu"
"""``LoraSlots.acquire``: the adapter was copied from the host cache into a GPU slot."""
FROM_DISK = "disk"
"""``LoraSlots.acquire``: the adapter was loaded cold (from storage) into both caches."""


@dataclass(slots=True)
class LoraLoadCounts:
    """Adapter loads since start, by source, and GPU-slot evictions."""

    from_host: int = 0
    from_disk: int = 0
    evictions: int = 0

    @property
    def loads(self) -> int:
        return self.from_host + self.from_disk


class LoraSlots:
    """Which adapters hold a GPU slot and which sit in the host cache, in least-recently-used order.

    At most ``max_loras`` adapters hold GPU slots; the host cache keeps up to ``max_cpu_loras``
    adapters, the GPU-resident ones included (as vLLM's ``--max-cpu-loras``, at least
    ``max_loras``). A request can run if its adapter holds a slot, or a slot is free, or a resident no
    running request uses can be evicted (the least recently used such one). An evicted adapter stays
    in the host cache while there is room there; loading from the host is cheaper than a cold load.
    """

    def __init__(self, max_loras: int, max_cpu_loras: int = 0) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self._gpu: OrderedDict[str, None] = OrderedDict()
        self._host: OrderedDict[str, None] = OrderedDict()
        self.counts = LoraLoadCounts()

    @property
    def loaded(self) -> tuple[str, ...]:
        """The GPU-resident adapters, least recently used first."""
        return tuple(self._gpu)

    @property
    def host_only(self) -> tuple[str, ...]:
        """The adapters in the host cache without a GPU slot, least recently used first."""
        return tuple(name for name in self._host if name not in self._gpu)

    def can_acquire(self, adapter: str, in_use: Iterable[str]) -> bool:
        """Whether ``adapter`` holds a slot or could get one now."""
        if adapter in self._gpu or len(self._gpu) < self.max_loras:
            return True
        busy = set(in_use)
        return any(name not in busy for name in self._gpu)

    def acquire(self, adapter: str, in_use: Iterable[str]) -> str | None:
        """Give ``adapter`` a GPU slot for a request about to run.

        Returns ``RESIDENT`` (it had one), ``FROM_HOST`` or ``FROM_DISK`` (it was loaded: the caller
        pays that source's delay), or ``None`` if no slot can be had now (the request must wait).
        """
        if adapter in self._gpu:
            self._gpu.move_to_end(adapter)
            self._host.move_to_end(adapter)
            return RESIDENT
        if len(self._gpu) >= self.max_loras:
            busy = set(in_use)
            idle = next((name for name in self._gpu if name not in busy), None)
            if idle is None:
                return None
            del self._gpu[idle]
            self.counts.evictions += 1
        source = FROM_HOST if adapter in self._host else FROM_DISK
        if source == FROM_DISK:
            self.counts.from_disk += 1
            self._make_host_room()
        else:
            self.counts.from_host += 1
        self._host[adapter] = None
        self._host.move_to_end(adapter)
        self._gpu[adapter] = None
        return source

    def _make_host_room(self) -> None:
        """Drop the least recently used host-only adapters until one more fits."""
        while len(self._host) >= self.max_cpu_loras:
            victim = next((name for name in self._host if name not in self._gpu), None)
            if victim is None:
                return
            del self._host[victim]
