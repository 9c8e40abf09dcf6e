"""The model names the pools serve, handed to the model-name label bound of the EPP's metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import structlog

from epp import labels
from epp.background import RepeatingTask
from epp.framework import Endpoint


class _Endpoints(Protocol):
    """An ``EndpointStore``, or every pool's endpoints (``PoolRegistry``)."""

    def endpoints(self) -> Iterable[Endpoint]: ...


log = structlog.get_logger("epp.datalayer.served_models")

DEFAULT_INTERVAL = 1.0


class ServedModels:
    """Keeps ``bound`` (default ``labels.MODEL_NAMES``) told of the pool's models."""

    def __init__(
        self,
        store: _Endpoints,
        interval: float = DEFAULT_INTERVAL,
        bound: labels.BoundedLabel | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self._store = store
        self.interval = interval
        self.bound = bound if bound is not None else labels.MODEL_NAMES
        self._known: set[str] = set()  # names already handed to the bound
        self._task = RepeatingTask(
            "served models", self.refresh, lambda: self.interval, log, "collecting served model names failed"
        )

    def refresh(self) -> None:
        """Tell the bound of every model name the endpoints currently report."""
        known = self._known
        new: set[str] = set()
        for endpoint in self._store.endpoints():
            m = endpoint.metrics
            for names in (m.served_models, m.active_models, m.waiting_models, m.loaded_adapters):
                new.update(n for n in names if n not in known)
        if new:
            known.update(new)
            self.bound.serve(sorted(new))

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
