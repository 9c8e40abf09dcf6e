"""The protobuf wire format, read field by field without generated message classes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """A malformed protobuf message."""


class Readable(Protocol):
    """Bytes read by position (``bytes``, ``memoryview``, or a view over a message's pieces)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> int: ...


def varint(data: Readable, i: int) -> tuple[int, int]:
    """The varint at ``i`` and the position after it."""
    value = shift = 0
    n = len(data)
    while True:
        if i >= n:
            raise WireError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift >= 70:
            raise WireError("varint too long")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` per field: an ``int`` for varints and fixed-width
    values, ``bytes`` for length-delimited ones. Groups are rejected."""
    i, n = 0, len(data)
    while i < n:
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("invalid field number 0")
        if wire == VARINT:
            value, i = varint(data, i)
            yield number, wire, value
        elif wire == LENGTH:
            size, i = varint(data, i)
            end = i + size
            if end > n:
                raise WireError("truncated length-delimited field")
            yield number, wire, data[i:end]
            i = end
        elif wire in (FIXED64, FIXED32):
            width = 8 if wire == FIXED64 else 4
            if i + width > n:
                raise WireError("truncated fixed-width field")
            yield number, wire, int.from_bytes(data[i : i + width], "little")
            i += width
        else:
            raise WireError(f"unsupported wire type {wire}")
