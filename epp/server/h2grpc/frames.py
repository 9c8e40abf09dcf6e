"""HTTP/2 wire pieces: frame types, flags, settings, error codes, the frame header and the few
HPACK representations the server writes (literal fields without indexing, never Huffman-coded)."""

from __future__ import annotations

import struct
from urllib.parse import quote

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = struct.Struct(">HBBBL")  # length (24 bits, as 16 + 8), type, flags, stream id
_HEADER_SIZE = FRAME_HEADER.size  # 9

# Frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE = range(6)
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(6, 10)

# Flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Settings
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

# Error codes
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = (1 << 31) - 1
MAX_FRAME_LIMIT = (1 << 24) - 1
DEFAULT_HEADER_TABLE = 4096

# What the server advertises. A stream's window is credited back as its messages are read, the
# connection's as DATA arrives; a peer may send frames of up to RECV_MAX_FRAME bytes (fewer frames
# for a long request body).
STREAM_WINDOW = 8 << 20
CREDIT_FROM = STREAM_WINDOW // 4  # a stream's window is credited back in steps of at least this
CONNECTION_WINDOW = 64 << 20
RECV_MAX_FRAME = 1 << 20
MAX_HEADER_LIST = 64 << 10


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: header and payload."""
    n = len(payload)
    return FRAME_HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def frame_header(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id)


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in values.items()))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">L", increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">L", code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">LL", last_stream_id, code) + debug)


# --- HPACK: what the server sends --------------------------------------------------------------


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with an N-bit prefix; ``first`` carries the representation's high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7, 0) + data  # H = 0: no Huffman coding


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing and with a literal name (the dynamic table is
    never touched, so the server keeps no encoder state)."""
    return b"\x00" + _string(name) + _string(value)


STATUS_200 = b"\x88"  # indexed: static table entry 8, ":status: 200"
RESPONSE_HEADERS = STATUS_200 + literal(b"content-type", b"application/grpc")


def status_fields(code: int, message: str) -> bytes:
    """``grpc-status`` and (when not empty) the percent-encoded ``grpc-message``."""
    block = literal(b"grpc-status", str(code).encode())
    if message:
        encoded = quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~", encoding="utf-8")
        block += literal(b"grpc-message", encoded[:8192].encode("ascii"))
    return block


OK_TRAILERS = status_fields(0, "")
