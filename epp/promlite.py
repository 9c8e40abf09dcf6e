"""Cheap Prometheus counters, gauges and histograms for the per-request path.

prometheus-client takes a lock and validates on every ``inc``/``observe`` (about 2 µs each); a
request records a dozen values. These primitives keep plain Python numbers per label set (the GIL
makes each update atomic; the request path runs on one event loop) and render them through a
prometheus-client collector at scrape time, so the exposition format, names and ``REGISTRY`` lookups
are unchanged. ``labels(...)`` returns a cached child; keep the child when recording repeatedly.

Labels fed from request data are declared with ``bounded={"label": bound}``: ``labels(...)``
passes those values through ``bound.bound(value)`` (``epp.labels.BoundedLabel``) before the child
lookup, so a client cannot create series without limit.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class LabelBound(Protocol):
    def bound(self, value: str) -> str: ...


class Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family:
    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        bounded: Mapping[str, LabelBound] | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        bounded = bounded or {}
        unknown = set(bounded) - set(self.labelnames)
        if unknown:
            raise ValueError(f"{name}: bounded labels {sorted(unknown)} are not among {self.labelnames}")
        self._bounded = tuple((i, bounded[n]) for i, n in enumerate(self.labelnames) if n in bounded)

    def _new_child(self) -> object:
        raise NotImplementedError

    def _bound(self, values: tuple[str, ...]) -> tuple[str, ...]:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        out = list(values)
        for i, b in self._bounded:
            out[i] = b.bound(out[i])
        return tuple(out)

    def _child(self, values: tuple[str, ...]) -> object:
        if self._bounded:
            values = self._bound(values)
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = self._new_child()
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(self._bound(values) if self._bounded else tuple(values), None)

    def __len__(self) -> int:
        """The number of series (label sets) recorded."""
        return len(self._children)


class Counter(_Family):
    def _new_child(self) -> Value:
        return Value()

    def labels(self, *values: str) -> Value:
        return self._child(values)  # type: ignore[return-value]

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def families(self) -> Iterator[Metric]:
        name = self.name.removesuffix("_total")
        fam = CounterMetricFamily(name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            fam.add_metric(list(values), child.value)  # type: ignore[attr-defined]
        yield fam


class Gauge(_Family):
    def _new_child(self) -> Value:
        return Value()

    def labels(self, *values: str) -> Value:
        return self._child(values)  # type: ignore[return-value]

    def set(self, value: float) -> None:
        self.labels().set(value)

    def families(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            fam.add_metric(list(values), child.value)  # type: ignore[attr-defined]
        yield fam


class Histogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        bounded: Mapping[str, LabelBound] | None = None,
    ) -> None:
        super().__init__(name, documentation, labelnames, bounded=bounded)
        self.bounds = tuple(float(b) for b in buckets if b != float("inf"))

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def labels(self, *values: str) -> HistogramChild:
        return self._child(values)  # type: ignore[return-value]

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def families(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        labels = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        for values, child in list(self._children.items()):
            counts = list(child.counts)  # type: ignore[attr-defined]
            cumulative, running = [], 0
            for le, c in zip(labels, counts, strict=True):
                running += c
                cumulative.append((le, running))
            fam.add_metric(list(values), cumulative, child.sum)  # type: ignore[attr-defined]
        yield fam


class Collector:
    """Exposes a set of families through a prometheus-client registry."""

    def __init__(self, *families: _Family) -> None:
        self._families = list(families)

    def add(self, *families: _Family) -> None:
        self._families.extend(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield from family.families()  # type: ignore[attr-defined]

    def describe(self) -> list[Metric]:
        return []


def register(*families: _Family, registry: CollectorRegistry = REGISTRY) -> None:
    """Expose ``families`` on ``registry`` (the default registry served on ``/metrics``)."""
    registry.register(Collector(*families))
