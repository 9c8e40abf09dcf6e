"""Targeted extraction of metric values from Prometheus text exposition (format 0.0.4).

A ``Selector`` (a PromQL instant selector with equality matchers, compiled once) finds its metric
at line starts with ``bytes.find`` and parses only the sample lines it needs, never the whole page.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

_EMPTY_LABELS: Mapping[str, str] = MappingProxyType({})

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*"

# One matcher inside the braces of a spec: name, operator, then a quoted or bare value.
_SPEC_MATCHER = re.compile(
    r"\s*(" + _LABEL_NAME + r")\s*(=~|!=|!~|=)\s*"
    r"(?:\"((?:[^\"\\]|\\.)*)\"|'((?:[^'\\]|\\.)*)'|`([^`]*)`|([^,}\s\"'`]*))\s*(,|(?=\}))"
)
# One label pair in an exposition sample line (values are always double-quoted there).
_SAMPLE_LABEL = re.compile(rb'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,?)')
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPE = {"n": "\n", "\\": "\\", '"': '"', "'": "'", "`": "`", "t": "\t"}
_NAME_END = frozenset(b"{ \t")
_PARSED_CACHE_SIZE = 256


@dataclass(slots=True, frozen=True)
class Sample:
    """One exposition sample. ``labels`` is empty unless labels were requested or matched."""

    value: float
    timestamp_ms: int | None = None
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY_LABELS)


_MISSING: Any = object()


@dataclass(slots=True)
class _LookupState:
    """What a selector learns across scrapes to find its lines faster (single event loop).

    ``from_end``: the family was last found in the second half of a page, so search backwards
    (pages keep their layout from scrape to scrape). ``parsed``: decoded labelled lines by raw
    bytes; info lines (cache config, LoRA) rarely change and decoding labels is the costly part of a
    lookup. Bounded; cleared when full.
    """

    from_end: bool = False
    parsed: dict[bytes, Sample | None] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class LoraInfo:
    """The decoded labels of ``vllm:lora_requests_info``; ``max_lora`` is None when absent/invalid."""

    max_lora: int | None
    running: tuple[str, ...]
    waiting: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class Selector:
    """A compiled metric spec. Build it with ``Selector.parse``; it holds the byte needles.

    Spec: ``name{label=value,...}``, quotes optional, equality matchers only (others are rejected at
    parse), ``__*`` labels ignored except ``__name__`` without a leading name; ``label=""`` matches
    series without that label. Among matches the largest explicit timestamp wins, else the first.
    """

    name: str
    matchers: tuple[tuple[str, str], ...] = ()
    _needle: bytes = field(default=b"", repr=False, compare=False)
    _state: _LookupState = field(default_factory=lambda: _LookupState(), repr=False, compare=False)

    @classmethod
    def parse(cls, spec: str) -> Selector:
        """Compile ``name{label=value,...}``; raises ``ValueError`` naming the spec on bad syntax."""
        text = spec.strip()
        matchers: tuple[tuple[str, str], ...] = ()
        brace = text.find("{")
        if brace < 0:
            name = text
        else:
            if not text.endswith("}"):
                raise ValueError(f"invalid metric spec {spec!r}: missing closing '}}'")
            name = text[:brace].strip()
            matchers, pseudo_name = _parse_matchers(spec, text[brace + 1 : -1])
            if not name:
                name = pseudo_name
        if not name:
            raise ValueError(f"invalid metric spec {spec!r}: no metric name")
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric spec {spec!r}: invalid metric name {name!r}")
        return cls(name=name, matchers=matchers, _needle=b"\n" + name.encode())

    def __str__(self) -> str:
        if not self.matchers:
            return self.name
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in self.matchers)
        return f"{self.name}{{{inner}}}"

    # --- extraction ------------------------------------------------------------------------

    def samples(self, body: bytes, with_labels: bool = False) -> list[Sample]:
        """Every sample of this metric name matching the matchers, in exposition order.

        Malformed sample lines of the family are skipped. Labels are decoded when ``with_labels``
        is set or when the selector has matchers (only then are they returned on the sample);
        otherwise the value is read after the line's last ``}`` and the labels are not validated.
        """
        parse_labels = with_labels or bool(self.matchers)
        state = self._state
        found: list[Sample] = []
        for rest in _family_lines(body, self._needle, state):
            if parse_labels:
                parsed = state.parsed
                sample = parsed.get(rest, _MISSING)
                if sample is _MISSING:
                    if len(parsed) >= _PARSED_CACHE_SIZE:
                        parsed.clear()
                    sample = parsed[rest] = _parse_sample(rest, True)
            else:
                sample = _parse_sample(rest, False)
            if sample is not None and (not self.matchers or _matches(sample.labels, self.matchers)):
                found.append(sample)
        return found

    def select(self, body: bytes, with_labels: bool = False) -> Sample | None:
        """The matching sample with the largest explicit timestamp, else the first; None if none."""
        found = self.samples(body, with_labels)
        if len(found) < 2:
            return found[0] if found else None
        best = found[0]
        for sample in found:
            if _newer(sample.timestamp_ms, best.timestamp_ms):
                best = sample
        return best

    def value(self, body: bytes) -> float | None:
        """The selected sample's value, or None when the family or a matching series is missing."""
        sample = self.select(body)
        return None if sample is None else sample.value

    def select_max_value(self, body: bytes) -> Sample | None:
        """The matching sample with the largest value (first on ties), with its labels."""
        best: Sample | None = None
        for sample in self.samples(body, with_labels=True):
            if best is None or sample.value > best.value:
                best = sample
        return best


def info_labels(body: bytes, selector: Selector) -> Mapping[str, str] | None:
    """Labels of the series an info metric selects (largest timestamp, else first); None if absent."""
    sample = selector.select(body, with_labels=True)
    return None if sample is None else sample.labels


def lora_info(body: bytes, selector: Selector) -> LoraInfo | None:
    """Decode the LoRA info series with the largest value; None when the family is absent."""
    sample = selector.select_max_value(body)
    if sample is None:
        return None
    labels = sample.labels
    max_lora: int | None
    try:
        max_lora = int(labels.get("max_lora", ""))
    except ValueError:
        max_lora = None
    return LoraInfo(
        max_lora=max_lora,
        running=split_csv(labels.get("running_lora_adapters", "")),
        waiting=split_csv(labels.get("waiting_lora_adapters", "")),
    )


def split_csv(text: str) -> tuple[str, ...]:
    """Comma-separated items, trimmed, empty items dropped."""
    return tuple(item for item in (part.strip() for part in text.split(",")) if item)


# --- helpers ---------------------------------------------------------------------------------


def _family_lines(body: bytes, needle: bytes, state: _LookupState) -> list[bytes]:
    """What follows the name on each sample line of one metric name (``needle = b"\\n" + name``).

    The exposition format requires all lines of a family to form one group, so only one block is
    read: the search finds any line of the block (from the start, or from the end when the family
    was last seen in the second half of a page), then walks back to the block's first line and
    forward to its last. A name found nowhere costs one ``bytes.find`` over the page.
    """
    name = needle[1:]
    size = len(name)
    body_end = len(body)
    name_end = _NAME_END
    if state.from_end:
        found = body.rfind(needle)
        while found >= 0 and (found + 1 + size >= body_end or body[found + 1 + size] not in name_end):
            found = body.rfind(needle, 0, found)
    else:
        found = body.find(needle)
        while found >= 0 and (found + 1 + size >= body_end or body[found + 1 + size] not in name_end):
            found = body.find(needle, found + 1)
    if found >= 0:
        start = found + 1
        state.from_end = start > body_end >> 1
        while start > 0:  # back to the first line of the block
            previous = body.rfind(b"\n", 0, start - 1) + 1
            if not (body.startswith(name, previous) and body[previous + size] in name_end):
                break
            start = previous
    elif body.startswith(name) and size < body_end and body[size] in name_end:
        start = 0
    else:
        return []
    end = body.find(b"\n", start)
    while end >= 0 and body.startswith(name, end + 1) and end + 1 + size < body_end:
        if body[end + 1 + size] not in name_end:
            break
        end = body.find(b"\n", end + 1)
    if end < 0:
        end = body_end
    if body.find(b"\n", start, end) < 0:
        return [body[start + size : end]]
    return [line[size:] for line in body[start:end].split(b"\n")]


def _parse_sample(rest: bytes, parse_labels: bool) -> Sample | None:
    """Parse what follows the metric name on a sample line: ``{labels} value [timestamp]``."""
    labels: Mapping[str, str] = _EMPTY_LABELS
    if rest[0] == 0x7B:  # "{"
        if parse_labels:
            parsed = _parse_sample_labels(rest)
            if parsed is None:
                return None
            labels, pos = MappingProxyType(parsed[0]), parsed[1]
        else:
            # Values follow the last "}" (label values may contain "}" but the value cannot).
            pos = rest.rfind(b"}") + 1
            if pos == 0:
                return None
        rest = rest[pos:]
    fields = rest.split()
    if not fields or len(fields) > 2:
        return None
    try:
        value = float(fields[0])
        timestamp = int(fields[1]) if len(fields) == 2 else None
    except ValueError:
        return None
    return Sample(value=value, timestamp_ms=timestamp, labels=labels)


def _parse_sample_labels(rest: bytes) -> tuple[dict[str, str], int] | None:
    """Decode ``{a="x",b="y\\"z"}`` at the start of ``rest``; returns labels and the offset after."""
    labels: dict[str, str] = {}
    pos = 1
    while True:
        while pos < len(rest) and rest[pos] in b" \t":
            pos += 1
        if pos < len(rest) and rest[pos] == 0x7D:  # "}"
            return labels, pos + 1
        m = _SAMPLE_LABEL.match(rest, pos)
        if m is None:
            return None
        raw = m.group(2).decode("utf-8", "replace")
        labels[m.group(1).decode()] = _unescape(raw) if "\\" in raw else raw
        pos = m.end()
        if not m.group(3):  # no comma: the closing brace must follow
            while pos < len(rest) and rest[pos] in b" \t":
                pos += 1
            if pos < len(rest) and rest[pos] == 0x7D:
                return labels, pos + 1
            return None


def _parse_matchers(spec: str, inner: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """Matchers of a spec's braces and the ``__name__`` value if one was given."""
    matchers: list[tuple[str, str]] = []
    pseudo_name = ""
    pos = 0
    inner = inner.strip()
    body = inner + "}"  # sentinel so the last matcher's look-ahead sees a closing brace
    while pos < len(inner):
        m = _SPEC_MATCHER.match(body, pos)
        if m is None:
            raise ValueError(f"invalid metric spec {spec!r}: cannot parse matcher at {inner[pos:]!r}")
        label, op = m.group(1), m.group(2)
        if op != "=":
            raise ValueError(f"invalid metric spec {spec!r}: only '=' matchers are supported, got {op!r}")
        if m.group(3) is not None:
            value = _unescape(m.group(3))
        elif m.group(4) is not None:
            value = _unescape(m.group(4))
        elif m.group(5) is not None:
            value = m.group(5)
        else:
            value = m.group(6)
        if label == "__name__":
            pseudo_name = value
        elif not label.startswith("__"):
            matchers.append((label, value))
        pos = m.end()
    return tuple(matchers), pseudo_name


def _newer(candidate: int | None, current: int | None) -> bool:
    """True when an explicit timestamp beats the current choice (absent timestamps never win)."""
    return candidate is not None and (current is None or candidate > current)


def _matches(labels: Mapping[str, str], matchers: tuple[tuple[str, str], ...]) -> bool:
    return all(labels.get(key, "") == value for key, value in matchers)


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda m: _UNESCAPE.get(m.group(1), "\\" + m.group(1)), text)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
