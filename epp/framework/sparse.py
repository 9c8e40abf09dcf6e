"""Labels that are mostly one value: a default and the few positions that differ.

A grouped scorer's answer (``Scorer.score_grouped``) may give its labels this way; the bulk path
then adds the default's weighted score to the whole column at once (kept across requests) and
patches only the exceptions, instead of reading a label per endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any


class SparseLabels:
    """``n`` labels: ``exceptions[i]`` at the positions it holds, ``default`` everywhere else.
    Iterating gives every label in order (what a dense consumer reads)."""

    __slots__ = ("default", "exceptions", "n")

    def __init__(self, n: int, default: Hashable, exceptions: Mapping[int, Any]) -> None:
        self.n = n
        self.default = default
        self.exceptions = exceptions

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        get, default = self.exceptions.get, self.default
        return (get(i, default) for i in range(self.n))


TOTALS_BLOCK = 64
"""Positions per block of ``Totals.bounds``."""


class Totals(list[float]):
    """A profile's weighted sums, with ``bounds`` when known: per block of ``TOTALS_BLOCK``
    positions, a value at least the block's largest sum (a picker may skip a block whose bound is
    below what it already holds, without reading it)."""

    __slots__ = ("bounds",)

    def __init__(self, values: Any = (), bounds: list[float] | None = None) -> None:
        super().__init__(values)
        self.bounds = bounds


class SparseRow(Sequence[float]):
    """A grouped scorer's scores from ``SparseLabels``: ``score_of(label)`` of each position's
    label, computed when read (read-only; ``top`` is the largest)."""

    __slots__ = ("_default", "_exceptions", "_score_of", "n")

    def __init__(
        self, n: int, default: Hashable, exceptions: Mapping[int, Any], score_of: Callable[[Any], float]
    ) -> None:
        self.n = n
        self._default = default
        self._exceptions = exceptions
        self._score_of = score_of

    @property
    def top(self) -> float:
        labels = set(self._exceptions.values())
        if len(self._exceptions) < self.n:
            labels.add(self._default)
        return max(map(self._score_of, labels)) if labels else float("-inf")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self._score_of(self._exceptions.get(i, self._default))

    def __iter__(self) -> Iterator[float]:
        get, default, score_of = self._exceptions.get, self._default, self._score_of
        return (score_of(get(i, default)) for i in range(self.n))
