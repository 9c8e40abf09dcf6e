"""``body_message.decode``: long request bodies sliced off the wire, everything else as protobuf."""

from __future__ import annotations

import itertools

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.server.body_message import SLICE_FROM, BodyMessage, Pieces, decode, decode_pieces

LONG = b'{"model":"m","messages":[' + b"x" * SLICE_FROM + b"]}"


def _body_message(body: bytes, eos: bool, *, metadata: bool = False) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=eos))
    if metadata:
        req.metadata_context.filter_metadata["envoy.lb"].fields["k"].string_value = "v"
    return req


@pytest.mark.parametrize("eos", [True, False])
@pytest.mark.parametrize("metadata", [True, False])
def test_a_long_body_is_sliced_with_its_flag_and_the_other_fields(eos: bool, metadata: bool) -> None:
    req = _body_message(LONG, eos, metadata=metadata)
    got = decode(req.SerializeToString())
    assert isinstance(got, BodyMessage)
    assert got.body == LONG and type(got.body) is bytes
    assert got.end_of_stream is eos
    assert got.rest.HasField("metadata_context") is metadata
    if metadata:
        assert got.rest.metadata_context == req.metadata_context
    assert got.rest.WhichOneof("request") is None


def test_short_bodies_and_other_messages_are_protobuf_messages() -> None:
    short = _body_message(b'{"model":"m"}', True)
    assert decode(short.SerializeToString()) == short
    headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True))
    assert decode(headers.SerializeToString()) == headers
    response = ep.ProcessingRequest(response_body=ep.HttpBody(body=LONG))
    assert decode(response.SerializeToString()) == response


def test_fields_it_does_not_know_go_to_protobuf() -> None:
    req = ep.ProcessingRequest(request_body=ep.HttpBody(body=LONG, grpc_message_compressed=True))
    got = decode(req.SerializeToString())
    assert isinstance(got, ep.ProcessingRequest) and got == req


def test_a_truncated_message_is_protobufs_error() -> None:
    data = _body_message(LONG, True).SerializeToString()
    with pytest.raises(DecodeError):
        decode(data[: len(data) - 10])


def test_an_empty_long_message_prefix_falls_back() -> None:
    # tag of request_body followed by an unterminated varint length
    with pytest.raises(DecodeError):
        decode(b"\x22" + b"\xff" * (SLICE_FROM + 1))


@settings(max_examples=60, deadline=None)
@given(
    body=st.binary(max_size=3000).map(lambda tail: b"p" * SLICE_FROM + tail),
    eos=st.booleans(),
    without_message=st.booleans(),
    metadata=st.booleans(),
)
def test_decoding_agrees_with_protobuf(body: bytes, eos: bool, without_message: bool, metadata: bool) -> None:
    req = _body_message(body, eos, metadata=metadata)
    req.request_body.end_of_stream_without_message = without_message
    got = decode(req.SerializeToString())
    assert isinstance(got, BodyMessage)
    assert (got.body, got.end_of_stream) == (req.request_body.body, req.request_body.end_of_stream)
    assert got.rest.metadata_context == req.metadata_context


def _split(data: bytes, cuts: list[int]) -> list[memoryview]:
    """``data`` cut at ``cuts`` (positions, any order, repeats allowed), as memoryviews."""
    edges = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    view = memoryview(data)
    return [view[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=80, deadline=None)
@given(
    body=st.binary(max_size=3000).map(lambda tail: b"q" * SLICE_FROM + tail),
    eos=st.booleans(),
    metadata=st.booleans(),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
)
def test_a_message_in_pieces_decodes_as_the_joined_bytes(
    body: bytes, eos: bool, metadata: bool, cuts: list[int]
) -> None:
    data = _body_message(body, eos, metadata=metadata).SerializeToString()
    pieces = _split(data, cuts)
    whole, got = decode(data), decode_pieces(pieces)
    assert isinstance(whole, BodyMessage) and isinstance(got, BodyMessage)
    assert type(got.body) is bytes
    assert (got.body, got.end_of_stream, got.rest) == (whole.body, whole.end_of_stream, whole.rest)


@settings(max_examples=80, deadline=None)
@given(data=st.binary(min_size=1, max_size=200), cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_pieces_index_and_slice_as_bytes(data: bytes, cuts: list[int]) -> None:
    view = Pieces(_split(data, cuts))
    assert len(view) == len(data)
    assert [view[i] for i in range(len(data))] == list(data)
    for start in range(0, len(data), 7):
        for stop in (start, start + 1, start + 13, len(data), len(data) + 5):
            assert view[start:stop] == data[start:stop]
    assert view[:] == data
    with pytest.raises(IndexError):
        view[len(data)]


def test_other_messages_in_pieces_go_to_protobuf() -> None:
    headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True))
    data = headers.SerializeToString()
    assert decode_pieces(_split(data, [1, 3])) == headers
    compressed = ep.ProcessingRequest(request_body=ep.HttpBody(body=LONG, grpc_message_compressed=True))
    data = compressed.SerializeToString()
    assert decode_pieces(_split(data, [5, 100, 9000])) == compressed
    truncated = _body_message(LONG, True).SerializeToString()[:-10]
    with pytest.raises(DecodeError):
        decode_pieces(_split(truncated, [2, 4000]))
