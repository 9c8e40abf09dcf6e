"""Decoding of the ext_proc request messages, with long request bodies taken straight from the wire.

A ``request_body`` message of a long body is decoded here instead of by protobuf: its body is
sliced once out of the received bytes (protobuf would copy it into the message, and reading
``body`` would copy it again), and the message's other fields (filter metadata) go to protobuf.
Any other message, a short body, or anything unexpected is decoded by protobuf as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _sliced(data: bytes) -> BodyMessage | None:
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


def decode(data: bytes) -> ep.ProcessingRequest | BodyMessage:
    """The gRPC request deserializer of the ext_proc service."""
    if len(data) >= SLICE_FROM and data[0] == _REQUEST_BODY_TAG:
        try:
            message = _sliced(data)
        except WireError:
            message = None
        if message is not None:
            return message
    return ep.ProcessingRequest.FromString(data)
