"""LoRA adapter slots of the simulated engine."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LoraSlots:
    """Which adapters are loaded, in least-recently-used order.

    At most ``max_loras`` at once. A request can run if its adapter is loaded, or a slot is free, or
    a loaded adapter no running request uses can be evicted; loading costs ``lora_load_time`` ms,
    added to the triggering request's time to first token.
    """

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._loaded: OrderedDict[str, None] = OrderedDict()

    @property
    def loaded(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    def can_acquire(self, adapter: str, in_use: Iterable[str]) -> bool:
        """Whether ``adapter`` is loaded or could be loaded now."""
        if adapter in self._loaded or len(self._loaded) < self.max_loras:
            return True
        busy = set(in_use)
        return any(name not in busy for name in self._loaded)

    def acquire(self, adapter: str, in_use: Iterable[str]) -> bool | None:
        """Make ``adapter`` loaded for a request about to run.

        Returns ``False`` if it was already loaded, ``True`` if it had to be loaded (the caller pays the
        load delay), ``None`` if no slot can be had now (the request must wait).
        """
        if adapter in self._loaded:
            self._loaded.move_to_end(adapter)
            return False
        if len(self._loaded) >= self.max_loras:
            busy = set(in_use)
            idle = next((name for name in self._loaded if name not in busy), None)
            if idle is None:
                return None
            del self._loaded[idle]
        self._loaded[adapter] = None
        return True
