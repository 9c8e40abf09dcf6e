"""gRPC request bodies for the parsers: the length-prefixed message frame and the protobuf wire
format, read field by field (only what routing needs; no generated message classes).
"""

from __future__ import annotations

from collections.abc import Iterator

from epp.framework import ErrorCode, InferenceError

_HEADER = 5  # compressed flag (1 byte) + message length (4 bytes, big endian)

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """A malformed protobuf message."""


def bad_request(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


def grpc_message(data: bytes) -> bytes:
    """The first message of a gRPC request body; ``ValueError`` on a short or compressed frame."""
    if len(data) < _HEADER:
        raise ValueError(f"invalid gRPC frame: expected at least {_HEADER} bytes for header, got {len(data)}")
    if data[0] == 1:
        raise ValueError("compressed gRPC payload is not supported")
    size = int.from_bytes(data[1:_HEADER], "big")
    if len(data) - _HEADER < size:
        raise ValueError(
            f"incomplete gRPC payload: header indicates {size} bytes, "
            f"but only {len(data) - _HEADER} bytes are available"
        )
    return data[_HEADER : _HEADER + size]


def grpc_frame(message: bytes) -> bytes:
    """``message`` as one uncompressed gRPC frame."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def _varint(data: bytes, i: int) -> tuple[int, int]:
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
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("invalid field number 0")
        if wire == VARINT:
            value, i = _varint(data, i)
            yield number, wire, value
        elif wire == LENGTH:
            size, i = _varint(data, i)
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


def uint32s(wire: int, value: int | bytes, out: list[int]) -> None:
    """Append a repeated ``uint32`` field's values (packed or not) to ``out``."""
    if wire == VARINT:
        assert isinstance(value, int)
        out.append(value & 0xFFFFFFFF)
    elif wire == LENGTH:
        assert isinstance(value, bytes)
        i = 0
        while i < len(value):
            v, i = _varint(value, i)
            out.append(v & 0xFFFFFFFF)
    else:
        raise WireError("repeated uint32 field with a fixed-width wire type")


def text(wire: int, value: int | bytes) -> str:
    """A ``string`` field's value."""
    if wire != LENGTH or not isinstance(value, bytes):
        raise WireError("string field with a non length-delimited wire type")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise WireError("string field is not valid UTF-8") from None


def message(wire: int, value: int | bytes) -> bytes:
    """An embedded message's (or a ``bytes`` field's) bytes."""
    if wire != LENGTH or not isinstance(value, bytes):
        raise WireError("message field with a non length-delimited wire type")
    return value
