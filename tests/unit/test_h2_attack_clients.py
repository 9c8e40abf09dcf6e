"""The attack clients of bench/h2_attacks.py write frames an HTTP/2 parser reads as intended."""

from __future__ import annotations

from hpack import Decoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from bench import _h2_attack_clients as c


def parse(data: bytes) -> list[Frame]:
    """Every frame of ``data`` with hyperframe (h2's frame layer); fails on a malformed one."""
    frames = []
    pos = 0
    while pos < len(data):
        f, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        f.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        frames.append(f)
        pos += 9 + length
    assert pos == len(data)
    return frames


def test_request_blocks_decode_to_the_ext_proc_call() -> None:
    decoder = Decoder()
    first, later = c.indexed_block()
    expected = [(n.decode(), v.decode()) for n, v in c.request_fields()]
    assert decoder.decode(first) == expected
    assert decoder.decode(later) == expected
    assert len(later) < 10  # indexed: the cheap HEADERS of the floods
    assert Decoder().decode(c.literal_block([(b"x-pad", b"aaa")])) == [*expected, ("x-pad", "aaa")]


def test_table_size_updates_then_fields_are_one_valid_block() -> None:
    block = c.table_size_updates(100) + c.literal_block()
    assert Decoder().decode(block)[2] == (":path", c.SERVICE_PATH.decode())
    frames = parse(c.header_frames(5, block, 64, end_stream=True))
    assert isinstance(frames[0], HeadersFrame) and frames[0].flags == {"END_STREAM"}
    assert all(isinstance(f, ContinuationFrame) for f in frames[1:])
    assert frames[-1].flags == {"END_HEADERS"} and all(f.stream_id == 5 for f in frames)
    assert b"".join(f.data for f in frames) == block


def test_one_byte_frames_carry_the_data_in_order() -> None:
    data = c.grpc_message(c.processing_body(10))
    frames = parse(c.one_byte_data(3, data))
    assert all(isinstance(f, DataFrame) and len(f.data) == 1 and f.stream_id == 3 for f in frames)
    assert b"".join(f.data for f in frames) == data
    conts = parse(c.one_byte_continuations(7, b"abc", last=True))
    assert [f.data for f in conts] == [b"a", b"b", b"c"] and conts[-1].flags == {"END_HEADERS"}
    assert not conts[0].flags


def test_control_frames() -> None:
    frames = parse(c.ping(42) + c.rst_stream(9) + c.settings({c.SETTINGS_INITIAL_WINDOW: 0}))
    assert isinstance(frames[0], PingFrame) and frames[0].opaque_data == (42).to_bytes(8, "big")
    assert isinstance(frames[1], RstStreamFrame) and frames[1].error_code == c.CANCEL
    assert isinstance(frames[2], SettingsFrame) and frames[2].settings == {c.SETTINGS_INITIAL_WINDOW: 0}


def test_grpc_message_is_a_processing_request() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    message = c.grpc_message(c.processing_headers(end_of_stream=True))
    assert message[0] == 0 and int.from_bytes(message[1:5], "big") == len(message) - 5
    request = ep.ProcessingRequest.FromString(message[5:])
    assert request.request_headers.end_of_stream
    paths = [h.raw_value for h in request.request_headers.headers.headers if h.key == ":path"]
    assert paths == [b"/v1/chat/completions"]
