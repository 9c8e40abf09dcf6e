"""gRPC request bodies for the parsers: the length-prefixed message frame, and typed reads of the
protobuf fields ``epp.framework.protowire`` yields (only what routing needs; no generated classes).
"""

from __future__ import annotations

from epp.framework import ErrorCode, InferenceError
from epp.framework.protowire import FIXED32, FIXED64, LENGTH, VARINT, WireError, fields, varint

_HEADER = 5  # compressed flag (1 byte) + message length (4 bytes, big endian)


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


def uint32s(wire: int, value: int | bytes, out: list[int]) -> None:
    """Append a repeated ``uint32`` field's values (packed or not) to ``out``."""
    if wire == VARINT:
        assert isinstance(value, int)
        out.append(value & 0xFFFFFFFF)
    elif wire == LENGTH:
        assert isinstance(value, bytes)
        i = 0
        while i < len(value):
            v, i = varint(value, i)
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


__all__ = [
    "FIXED32",
    "FIXED64",
    "LENGTH",
    "VARINT",
    "WireError",
    "bad_request",
    "fields",
    "grpc_frame",
    "grpc_message",
    "message",
    "text",
    "uint32s",
]
