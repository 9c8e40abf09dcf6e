"""Decoding of the ext_proc request messages, with long request bodies taken straight from the wire.

A ``request_body`` message of a long body is decoded here instead of by protobuf: its body is
sliced once out of the received bytes (protobuf would copy it into the message, and reading
``body`` would copy it again), and the message's other fields (filter metadata) go to protobuf.
A message that arrived in several pieces (``decode_pieces``) is read in place, so joining the body's
pieces is its only copy. Any other message, a short body, or anything unexpected is decoded by
protobuf as it is.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import overload

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from epp.framework.protowire import WireError, varint

# Bodies from this size on are sliced off the wire; below it protobuf is cheaper than Python.
SLICE_FROM = 16 * 1024

_REQUEST_BODY_TAG = 0x22  # ProcessingRequest.request_body: field 4, length-delimited
_BODY_TAG = 0x0A  # HttpBody.body: field 1, length-delimited
_EOS_TAG = 0x10  # HttpBody.end_of_stream: field 2, varint
_EOS_WITHOUT_MESSAGE_TAG = 0x18  # HttpBody.end_of_stream_without_message: field 3, varint
_EMPTY = ep.ProcessingRequest()


@dataclass(slots=True)
class BodyMessage:
    """A ``request_body`` message: the body's bytes, its flag, and the message's other fields."""

    body: bytes
    end_of_stream: bool
    rest: ep.ProcessingRequest  # metadata_context, attributes, ... (no request oneof set)


class Pieces:
    """The bytes of one message received in pieces, read in place: an index reads one byte, a
    slice joins the pieces it covers (one copy)."""

    __slots__ = ("_pieces", "_size", "_starts")

    def __init__(self, pieces: list[memoryview]) -> None:
        self._pieces = pieces
        self._starts: list[int] = []
        size = 0
        for piece in pieces:
            self._starts.append(size)
            size += len(piece)
        self._size = size

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> bytes: ...

    def __getitem__(self, key: int | slice) -> int | bytes:
        if isinstance(key, slice):
            start, stop, _ = key.indices(self._size)
            return self._join(start, stop)
        if not 0 <= key < self._size:
            raise IndexError(key)
        i = bisect_right(self._starts, key) - 1
        return self._pieces[i][key - self._starts[i]]

    def _join(self, start: int, stop: int) -> bytes:
        if start >= stop:
            return b""
        starts, pieces = self._starts, self._pieces
        out = []
        for i in range(bisect_right(starts, start) - 1, len(pieces)):
            begin = starts[i]
            if begin >= stop:
                break
            piece = pieces[i]
            out.append(piece[max(start - begin, 0) : min(stop - begin, len(piece))])
        return b"".join(out)


def _sliced(data: bytes | Pieces) -> BodyMessage | None:
    """``data`` as a BodyMessage, or None when it is anything else than a well-formed body message
    with only the fields this knows (protobuf then decodes it, and reports what is wrong)."""
    size, start = varint(data, 1)
    end = start + size
    if end > len(data):
        return None
    body = b""
    eos = False
    pos = start
    while pos < end:
        tag = data[pos]
        if tag == _BODY_TAG:
            n, pos = varint(data, pos + 1)
            if pos + n > end:
                return None
            body = data[pos : pos + n]
            pos += n
        elif tag in (_EOS_TAG, _EOS_WITHOUT_MESSAGE_TAG):
            flag, pos = varint(data, pos + 1)
            if tag == _EOS_TAG:
                eos = flag != 0
        else:  # another field (e.g. a compressed gRPC message flag): protobuf decodes the message
            return None
    if pos != end:
        return None
    rest = ep.ProcessingRequest.FromString(data[end:]) if end < len(data) else _EMPTY
    if rest.WhichOneof("request") is not None:  # a second request member: let protobuf decide
        return None
    return BodyMessage(body, eos, rest)


def decode(data: bytes | Pieces) -> ep.ProcessingRequest | BodyMessage:
    """The gRPC request deserializer of the ext_proc service."""
    if len(data) >= SLICE_FROM and data[0] == _REQUEST_BODY_TAG:
        try:
            message = _sliced(data)
        except WireError:
            message = None
        if message is not None:
            return message
    return ep.ProcessingRequest.FromString(data if isinstance(data, bytes) else data[:])


def decode_pieces(pieces: list[memoryview]) -> ep.ProcessingRequest | BodyMessage:
    """``decode`` for a message received in several pieces (``h2grpc.Server.add_piece_decoder``)."""
    return decode(Pieces(pieces))
