"""A metric scorer's scores kept as a column that follows metric changes position by position.

``Scorer.score_column`` (optional, for ``metrics_only`` scorers) returns one for candidates whose
metrics are all fresh; the bulk scoring path keeps it while the candidate list is the same and,
when the metrics journal names a few changed endpoints, asks it to ``update`` those positions
instead of scoring every candidate again. ``scores`` must equal what ``score`` would return.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any


class ScoreColumn(abc.ABC):
    """``scores``: the current scores (a list replaced, never changed in place, by ``update``:
    earlier readers keep what they read); ``top``: their maximum when known without a pass (else
    None)."""

    scores: list[float]
    top: float | None = None

    @abc.abstractmethod
    def update(self, endpoints: Sequence[Any], changed: Sequence[int]) -> int:
        """Follow the new metrics of ``endpoints[i]`` for ``i`` in ``changed`` (all fresh, the same
        candidate list as before): ``PATCHED`` when only those positions' scores changed,
        ``REPLACED`` when others did too (e.g. a min-max range moved), ``REBUILD`` when the column
        must be built again."""


REBUILD = 0
PATCHED = 1
REPLACED = 2
