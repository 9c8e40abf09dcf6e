"""Cheap Prometheus counters, gauges and histograms for the per-request path.

Plain Python numbers per label set, rendered at scrape time through a prometheus-client collector.
``alias`` renders a deprecated name from a current family at scrape time (dual emission without a
second update per event). ``configure_exposition`` leaves out the deprecated families (those whose
help text says ``Deprecated: use ...``) and the families registered for plugins that are not loaded.
"""

from __future__ import annotations

import bisect
import gzip
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.utils import floatToGoString

OVERFLOW = "other"
_DEPRECATED_HELP = re.compile(r"\bDeprecated: [Uu]se ")
MAX_BOUNDED_SERIES = 2000  # series of a family with bounded labels before new combinations fold


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
    """Children by label values; bounded labels pass through their bound before the lookup.

    A family with bounded labels stops at ``MAX_BOUNDED_SERIES`` combinations; later ones record with
    every bounded label set to ``other``. Updates are plain additions (one event loop, the GIL).
    """

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
        self.deprecated = _DEPRECATED_HELP.search(documentation) is not None  # a twin of a current name
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        self._texts: dict[tuple[str, ...], str] = {}
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
            child = self._create(values)
        return child

    def _create(self, values: tuple[str, ...]) -> object:
        """A new child for bounded ``values``; past the series cap the bounded labels fold."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        if self._bounded and len(self._children) >= MAX_BOUNDED_SERIES:
            # Each bounded label has few values, but their combinations could still multiply
            # (a client pairing models with rewrite-header targets): fold the new combination.
            out = list(values)
            for i, _ in self._bounded:
                out[i] = OVERFLOW
            values = tuple(out)
            child = self._children.get(values)
            if child is not None:
                return child
        child = self._children[values] = self._new_child()
        return child

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        """A snapshot of (label values, child) to render."""
        return list(self._children.items())

    def _label_text(self, values: tuple[str, ...]) -> str:
        """``a="x",b="y"`` for one series; cached (only the scrape thread reads the cache)."""
        text = self._texts.get(values)
        if text is None:
            pairs = sorted(zip(self.labelnames, values, strict=True))  # prometheus-client's order
            text = self._texts[values] = ",".join(f'{n}="{_escape(v)}"' for n, v in pairs)
        return text

    def _header(self, name: str, kind: str) -> str:
        doc = self.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"

    def remove(self, *values: str) -> None:
        key = self._bound(values) if self._bounded else tuple(values)
        self._children.pop(key, None)
        self._texts.pop(key, None)
        getattr(self, "_rendered", {}).pop(key, None)

    def _render_values(self, name: str, kind: str, out: list[str]) -> None:
        out.append(self._header(name, kind))
        for values, child in self._items():
            text = self._label_text(values)
            v = _fmt(child.value)
            out.append(f"{name}{{{text}}} {v}\n" if text else f"{name} {v}\n")

    def __len__(self) -> int:
        """The number of series (label sets) recorded."""
        return len(self._children)


class Counter(_Family):
    def _new_child(self) -> Value:
        return Value()

    def labels(self, *values: str) -> Value:
        return self._child(values)  # type: ignore[return-value]

    def at(self, key: tuple[str, ...]) -> Value:
        """The child of ``key`` whose bounded labels are bound already: one lookup once it exists."""
        child = self._children.get(key)
        return child if child is not None else self._create(key)  # type: ignore[return-value]

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def families(self) -> Iterator[Metric]:
        name = self.name.removesuffix("_total")
        fam = CounterMetricFamily(name, self.documentation, labels=self.labelnames)
        for values, child in self._items():
            fam.add_metric(list(values), child.value)
        yield fam

    def render(self, out: list[str]) -> None:
        self._render_values(self.name.removesuffix("_total") + "_total", "counter", out)


class Gauge(_Family):
    def _new_child(self) -> Value:
        return Value()

    def labels(self, *values: str) -> Value:
        return self._child(values)  # type: ignore[return-value]

    def at(self, key: tuple[str, ...]) -> Value:
        """The child of ``key`` whose bounded labels are bound already: one lookup once it exists."""
        child = self._children.get(key)
        return child if child is not None else self._create(key)  # type: ignore[return-value]

    def set(self, value: float) -> None:
        self.labels().set(value)

    def families(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._items():
            fam.add_metric(list(values), child.value)
        yield fam

    def render(self, out: list[str]) -> None:
        self._render_values(self.name, "gauge", out)


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
        self._les = (*(floatToGoString(b) for b in self.bounds), "+Inf")
        self._rendered: dict[tuple[str, ...], tuple[int, str]] = {}  # scrape thread only

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def labels(self, *values: str) -> HistogramChild:
        return self._child(values)  # type: ignore[return-value]

    def at(self, key: tuple[str, ...]) -> HistogramChild:
        """The child of ``key`` whose bounded labels are bound already: one lookup once it exists."""
        child = self._children.get(key)
        return child if child is not None else self._create(key)  # type: ignore[return-value]

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def families(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        labels = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        for values, child in self._items():
            counts = list(child.counts)
            cumulative, running = [], 0
            for le, c in zip(labels, counts, strict=True):
                running += c
                cumulative.append((le, running))
            fam.add_metric(list(values), cumulative, child.sum)
        yield fam

    def render(self, out: list[str]) -> None:
        name = self.name
        out.append(self._header(name, "histogram"))
        rendered = self._rendered
        for values, child in self._items():
            counts = list(child.counts)
            n = sum(counts)
            cached = rendered.get(values)
            if cached is not None and cached[0] == n:  # no observation since the last scrape
                out.append(cached[1])
                continue
            text = self._series_text(values, counts, child.sum)
            rendered[values] = (n, text)
            out.append(text)

    def _series_text(self, values: tuple[str, ...], counts: list[int], total_sum: float) -> str:
        name = self.name
        text = self._label_text(values)
        pairs = sorted(zip(self.labelnames, values, strict=True))
        before = ",".join(f'{n}="{_escape(v)}"' for n, v in pairs if n < "le")
        after = text[len(before) :]  # the labels that sort after "le", with their leading comma
        if not before and after:
            after = "," + after
        head = f"{name}_bucket{{{before}," if before else f"{name}_bucket{{"
        tail = f"{{{text}}} " if text else " "
        lines, running = [], 0
        for le, c in zip(self._les, counts, strict=True):
            running += c
            lines.append(f'{head}le="{le}"{after}}} {running}.0\n')
        lines.append(f"{name}_count{tail}{running}.0\n{name}_sum{tail}{_fmt(total_sum)}\n")
        return "".join(lines)


class _Projection:
    """How a deprecated family's series come from a current family's: label positions, summing."""

    def __init__(self, source: _Family, labelnames: Sequence[str], from_labels: Sequence[str] | None) -> None:
        from_labels = tuple(from_labels) if from_labels is not None else tuple(labelnames)
        if len(from_labels) != len(labelnames):
            raise ValueError(f"{source.name}: {len(labelnames)} alias labels but {len(from_labels)} sources")
        missing = [n for n in from_labels if n not in source.labelnames]
        if missing:
            raise ValueError(f"{source.name}: alias sources {missing} are not among {source.labelnames}")
        self.source = source
        self.index = tuple(source.labelnames.index(n) for n in from_labels)
        self.identity = self.index == tuple(range(len(source.labelnames)))
        self._keys: dict[tuple[str, ...], tuple[str, ...]] = {}  # source key -> alias key

    def key(self, values: tuple[str, ...]) -> tuple[str, ...]:
        k = self._keys.get(values)
        if k is None:
            k = self._keys[values] = tuple(values[i] for i in self.index)
        return k


class _AliasValues:
    """Counter or gauge alias: the current family's values, summed per alias label set."""

    _projection: _Projection

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        p = self._projection
        items = p.source._items()
        if p.identity:
            return items
        summed: dict[tuple[str, ...], Value] = {}
        for values, child in items:
            k = p.key(values)
            v = summed.get(k)
            if v is None:
                v = summed[k] = Value()
            v.value += child.value
        return list(summed.items())


class AliasCounter(_AliasValues, Counter):
    pass


class AliasGauge(_AliasValues, Gauge):
    pass


class AliasHistogram(Histogram):
    _projection: _Projection

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        p = self._projection
        items = p.source._items()
        if p.identity:
            return items
        summed: dict[tuple[str, ...], HistogramChild] = {}
        for values, child in items:
            k = p.key(values)
            h = summed.get(k)
            if h is None:
                h = summed[k] = HistogramChild(self.bounds)
            counts = h.counts
            for i, c in enumerate(list(child.counts)):
                counts[i] += c
            h.sum += child.sum
        return list(summed.items())


def alias(
    source: _Family,
    name: str,
    documentation: str,
    labelnames: Sequence[str] | None = None,
    *,
    from_labels: Sequence[str] | None = None,
) -> _Family:
    """A deprecated name for ``source``, rendered from it at scrape time (nothing is recorded twice).

    ``labelnames`` (default: the source's) may drop source labels, whose series are then summed, and
    ``from_labels`` names the source label each alias label takes its value from (a renamed label).
    Histogram aliases share the source's buckets.
    """
    names = tuple(labelnames) if labelnames is not None else source.labelnames
    fam: _Family
    if isinstance(source, Histogram):
        fam = AliasHistogram(name, documentation, names, buckets=source.bounds)
    elif isinstance(source, Counter):
        fam = AliasCounter(name, documentation, names)
    elif isinstance(source, Gauge):
        fam = AliasGauge(name, documentation, names)
    else:
        raise TypeError(f"cannot alias {type(source).__name__}")
    fam._projection = _Projection(source, names, from_labels)
    fam.deprecated = True
    return fam


class _Exposition:
    """What ``/metrics`` shows: the deprecated twins or not, and which owners' families."""

    emit_deprecated = True
    loaded: frozenset[str] | None = None  # owners whose families are shown; None: every family


_EXPOSITION = _Exposition()


def configure_exposition(*, emit_deprecated: bool = True, loaded: Iterable[str] | None = None) -> None:
    """``emit_deprecated=False`` leaves the deprecated twins out; ``loaded``: the owners (plugin type
    names, ``flow-control``) whose families are shown; families registered without owners always are."""
    _EXPOSITION.emit_deprecated = emit_deprecated
    _EXPOSITION.loaded = frozenset(loaded) if loaded is not None else None


class Collector:
    """Exposes a set of families through a prometheus-client registry; ``owners``: the plugin types
    (or features) they belong to, shown only while one of them is loaded (``configure_exposition``)."""

    def __init__(self, *families: _Family, owners: Iterable[str] = ()) -> None:
        self._families = list(families)
        self.owners = frozenset(owners)

    def add(self, *families: _Family) -> None:
        self._families.extend(families)

    def _shown(self) -> Iterator[_Family]:
        loaded = _EXPOSITION.loaded
        if self.owners and loaded is not None and not self.owners & loaded:
            return
        deprecated = _EXPOSITION.emit_deprecated
        for family in self._families:
            if deprecated or not family.deprecated:
                yield family

    def collect(self) -> Iterator[Metric]:
        if getattr(_rendering, "on", False):  # exposition() writes these families itself
            return
        for family in self._shown():
            yield from family.families()  # type: ignore[attr-defined]

    def render(self, out: list[str]) -> None:
        for family in self._shown():
            family.render(out)  # type: ignore[attr-defined]

    def describe(self) -> list[Metric]:
        return []


_rendering = threading.local()
_collectors: dict[int, list[Collector]] = {}  # by id(registry)


def register(*families: _Family, registry: CollectorRegistry = REGISTRY, owners: Iterable[str] = ()) -> None:
    """Expose ``families`` on ``registry`` (the default registry served on ``/metrics``); ``owners``:
    the plugin types they belong to (see :class:`Collector`)."""
    collector = Collector(*families, owners=owners)
    registry.register(collector)
    _collectors.setdefault(id(registry), []).append(collector)


def family(name: str, registry: CollectorRegistry = REGISTRY) -> _Family | None:
    """The registered family named ``name`` (to read its current values), or None."""
    for collector in list(_collectors.get(id(registry), [])):
        for fam in collector._families:
            if fam.name == name:
                return fam
    return None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    return floatToGoString(value)


def exposition(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The text-format page of ``registry``: prometheus-client's collectors, then these families."""
    _rendering.on = True
    try:
        head = generate_latest(registry)
    finally:
        _rendering.on = False
    out: list[str] = []
    for collector in list(_collectors.get(id(registry), ())):
        collector.render(out)
    return head + "".join(out).encode()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _app(registry: CollectorRegistry) -> Callable[[dict[str, Any], Any], Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b""]
        body = exposition(registry)
        headers = [("Content-Type", CONTENT_TYPE_LATEST)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    return app


def start_http_server(
    port: int,
    addr: str = "0.0.0.0",
    registry: CollectorRegistry = REGISTRY,
    middleware: Callable[[Any], Any] | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``exposition(registry)`` on ``addr:port`` from a daemon thread (any path), through
    ``middleware`` (a WSGI app wrapper, e.g. authentication) when given.

    These families' text is written directly (label strings cached per series), several times faster
    than one sample object per bucket, so a scrape holds the GIL for much less time.
    """

    class _Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    app = _app(registry)
    httpd = make_server(
        addr, port, middleware(app) if middleware else app, _Server, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
