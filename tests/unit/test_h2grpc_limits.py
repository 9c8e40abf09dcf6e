"""epp's HTTP/2 server against abusive peers, with raw frames: each limit answers as RFC 9113 says
(GOAWAY or RST_STREAM and its code), counts in llm_d_epp_extproc_h2_limit_total, and what the
server holds for the peer stays bounded; a well-behaved request on the same server still works."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from hpack import Encoder

from epp.server.h2grpc import Limits, Server
from epp.server.h2grpc.call import Call
from epp.server.h2grpc.connection import Connection
from epp.server.h2grpc.limits import LIMIT_TOTAL
from tests.unit.test_h2grpc import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    Frame,
    Probe,
    Raw,
    goaway_codes,
    grpc_frame,
    grpc_messages,
    raw_frame,
    read_response,
    request_block,
    start_server,
    window_update,
)

PRIORITY = 2
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB
STREAM_WINDOW = 8 << 20  # what the server advertises per stream


def rst_code(frame: Frame) -> int:
    return int(struct.unpack(">L", frame[3])[0])


def limit_count(limit: str) -> float:
    return LIMIT_TOTAL.labels(limit).value


def rst(sid: int, code: int = CANCEL) -> bytes:
    return raw_frame(RST_STREAM, 0, sid, struct.pack(">L", code))


class Peer:
    """A server of its own (``limits`` as given) and raw connections to it."""

    def __init__(self, server: Server, port: int, probe: Probe) -> None:
        self.server, self.port, self.probe = server, port, probe
        self.opened: list[Raw] = []

    async def connect(self, first: bytes = PREFACE + raw_frame(SETTINGS, 0, 0)) -> Raw:
        conn = await Raw.open(self.port, first)
        self.opened.append(conn)
        return conn

    def connection(self) -> Connection:
        (conn,) = self.server.connections
        return conn

    async def served(self) -> None:
        """A well-behaved request on a new connection still gets its answer."""
        conn = await self.connect()
        conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Unary")))
        conn.send(raw_frame(DATA, END_STREAM, 1, grpc_frame(b"ok")))
        fields, body = await read_response(conn, 1)
        assert fields["grpc-status"] == "0" and grpc_messages(body) == [b"re:ok"]


@pytest.fixture
async def peer() -> AsyncIterator[Callable[..., Any]]:
    async with AsyncExitStack() as stack:
        made: list[Peer] = []

        async def make(**limits: Any) -> Peer:
            probe = Probe()
            options = {"limits": Limits(**limits)} if limits else {}
            server, port = await start_server(stack, probe, **options)
            made.append(Peer(server, port, probe))
            return made[-1]

        yield make
        for p in made:
            for conn in p.opened:
                await conn.close()


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


# --- 1. header blocks ---------------------------------------------------------------------------


async def test_empty_continuation_flood_ends_at_the_frame_cap(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    before = limit_count("header_block_frames")
    conn = await p.connect()
    block = request_block("/test.T/Unary")
    conn.send(raw_frame(HEADERS, 0, 1, block[:4]) + raw_frame(CONTINUATION, 0, 1, b"") * 10_000)
    assert goaway_codes(await conn.rest()) == [ENHANCE_YOUR_CALM]
    assert limit_count("header_block_frames") == before + 1
    await p.served()


async def test_a_block_in_a_few_continuations_is_still_served(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    block = request_block("/test.T/Unary", ("x-pad", "v" * 3000))
    parts = [block[i : i + 300] for i in range(0, len(block), 300)]  # 11 frames, under 16
    frames = raw_frame(HEADERS, 0, 1, parts[0])
    frames += b"".join(raw_frame(CONTINUATION, 0, 1, x) for x in parts[1:-1])
    conn.send(frames + raw_frame(CONTINUATION, END_HEADERS, 1, parts[-1]))
    conn.send(raw_frame(DATA, END_STREAM, 1, grpc_frame(b"ok")))
    fields, _ = await read_response(conn, 1)
    assert fields["grpc-status"] == "0"


async def test_a_single_headers_frame_over_the_block_cap_is_refused(peer: Callable[..., Any]) -> None:
    """One HEADERS frame (the server takes frames of up to 1 MiB) holding a block over 64 KiB:
    refused before it is decoded (no 770 ns per byte of HPACK decoding)."""
    p: Peer = await peer()
    conn = await p.connect()
    big = Encoder().encode([(":method", "POST"), ("x-big", "v" * 70_000)], huffman=False)
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, big))
    assert goaway_codes(await conn.rest()) == [ENHANCE_YOUR_CALM]


# --- 2. rapid reset -----------------------------------------------------------------------------


async def test_rapid_reset_ends_the_connection_with_enhance_your_calm(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()  # the defaults: 1000 at once, 100 per second
    before = limit_count("resets")
    conn = await p.connect()
    block = request_block("/test.T/Hold")
    conn.send(b"".join(raw_frame(HEADERS, END_HEADERS, sid, block) + rst(sid) for sid in range(1, 3001, 2)))
    assert goaway_codes(await conn.rest()) == [ENHANCE_YOUR_CALM]
    assert limit_count("resets") == before + 1
    await p.served()


async def test_streams_reset_before_their_task_ran_are_freed_without_a_collection(
    peer: Callable[..., Any],
) -> None:
    """No Call <-> Task <-> traceback cycle: with the collector off, every call is gone once the
    connection is idle (the old server kept all of them until a full collection)."""
    p: Peer = await peer()
    conn = await p.connect()
    block = request_block("/test.T/Hold")
    gc.collect()
    gc.disable()
    try:
        conn.send(
            b"".join(raw_frame(HEADERS, END_HEADERS, sid, block) + rst(sid) for sid in range(1, 401, 2))
        )
        conn.send(raw_frame(PING, 0, 0, b"synced!!"))
        await conn.until(lambda fr: fr[0] == PING)
        await until(lambda: not p.connection().calls and not p.server.open_calls())
        for _ in range(3):
            await asyncio.sleep(0)
        assert sum(isinstance(o, Call) for o in gc.get_objects()) == 0
    finally:
        gc.enable()
    assert not p.probe.started.is_set()


async def test_resets_after_an_answer_are_not_counted(peer: Callable[..., Any]) -> None:
    """Envoy half-closes and resets each ext_proc stream once answered: never a Rapid Reset."""
    p: Peer = await peer(reset_burst=5, reset_rate=0.001)
    conn = await p.connect()
    block = request_block("/test.T/Echo")
    for sid in range(1, 41, 2):
        conn.send(raw_frame(HEADERS, END_HEADERS, sid, block) + raw_frame(DATA, 0, sid, grpc_frame(b"m")))
        await conn.until(lambda fr, sid=sid: fr[0] == DATA and fr[2] == sid)
        conn.send(raw_frame(DATA, END_STREAM, sid, b"") + rst(sid))
    conn.send(raw_frame(PING, 0, 0, b"stillok!"))
    got = await conn.until(lambda fr: fr[0] in (PING, GOAWAY))
    assert got[0] == PING


# --- 3. writes slow reading ---------------------------------------------------------------------


async def test_reading_pauses_while_the_peer_does_not_read(peer: Callable[..., Any]) -> None:
    """PINGs from a peer that never reads: the ACKs queue up to the high-water mark, then the
    server stops reading (what it holds stays bounded), and resumes once the peer reads."""
    p: Peer = await peer(idle_frame_burst=0, write_buffer_high=64 << 10, write_buffer_low=16 << 10)
    before = limit_count("write_buffer")
    sock = socket.socket()  # small socket buffers: the kernel does not absorb what the server sends
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", p.port))
    sock.setblocking(False)
    conn = Raw(*await asyncio.open_connection(sock=sock))
    p.opened.append(conn)
    conn.send(PREFACE + raw_frame(SETTINGS, 0, 0))
    await conn.until(lambda fr: fr[0] == SETTINGS and bool(fr[1] & 0x1))  # what came before the PINGs
    p.connection().transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    ping = raw_frame(PING, 0, 0, b"12345678")
    conn.send(ping * 150_000)  # 2.5 MB of PINGs: their ACKs would be as much
    await until(lambda: len(p.server.connections) == 1 and not p.connection().transport.is_reading())
    transport = p.connection().transport
    for _ in range(20):  # what is queued stays bounded: the mark and one read's answers
        await asyncio.sleep(0.01)  # (reading resumes whenever the kernel takes some, then pauses again)
        assert transport.get_write_buffer_size() <= (64 << 10) + (256 << 10)
    assert limit_count("write_buffer") > before
    # the peer reads: every PING is answered in the end, and reading resumed
    acks = await asyncio.wait_for(conn.reader.readexactly(150_000 * len(ping)), 10)
    assert acks == raw_frame(PING, 0x1, 0, b"12345678") * 150_000
    assert transport.is_reading()


# --- 4. streams, open calls, stalled writes ------------------------------------------------------


async def test_max_concurrent_streams_is_advertised_and_enforced(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    _, _, _, payload = await conn.until(lambda fr: fr[0] == SETTINGS and not fr[1] & 0x1)
    settings = dict(struct.unpack(">HL", payload[i : i + 6]) for i in range(0, len(payload), 6))
    assert settings[0x3] == 500
    block = request_block("/test.T/Hold")
    conn.send(b"".join(raw_frame(HEADERS, END_HEADERS, 2 * i + 1, block) for i in range(501)))
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 1001, REFUSED_STREAM)
    assert len(p.connection().calls) == 500


async def test_open_calls_are_capped_across_connections(peer: Callable[..., Any]) -> None:
    p: Peer = await peer(max_open_calls=3)
    before = limit_count("open_calls")
    first, second = await p.connect(), await p.connect()
    block = request_block("/test.T/Hold")
    first.send(b"".join(raw_frame(HEADERS, END_HEADERS, sid, block) for sid in (1, 3)))
    second.send(raw_frame(HEADERS, END_HEADERS, 1, block))
    await until(lambda: p.server.open_calls() == 3)
    second.send(raw_frame(HEADERS, END_HEADERS, 3, block))
    got = await second.until(lambda fr: fr[0] == RST_STREAM)
    assert (got[2], rst_code(got)) == (3, REFUSED_STREAM)
    assert limit_count("open_calls") == before + 1
    first.send(rst(1))  # one ends: a new call is taken again
    await until(lambda: p.server.open_calls() == 2)
    second.send(raw_frame(HEADERS, END_HEADERS, 5, block))
    await until(lambda: p.server.open_calls() == 3)


async def test_a_reply_stalled_on_a_shut_stream_window_resets_the_stream(peer: Callable[..., Any]) -> None:
    p: Peer = await peer(write_stall_timeout=0.2)
    conn = await p.connect(PREFACE + raw_frame(SETTINGS, 0, 0, struct.pack(">HL", 0x4, 0)))  # window 0
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Unary")))
    conn.send(raw_frame(DATA, END_STREAM, 1, grpc_frame(b"x")))
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 1, CANCEL)
    assert not p.connection().calls


async def test_a_reply_stalled_on_the_connection_window_closes_the_connection(
    peer: Callable[..., Any],
) -> None:
    p: Peer = await peer(write_stall_timeout=0.2)
    conn = await p.connect(PREFACE + raw_frame(SETTINGS, 0, 0, struct.pack(">HL", 0x4, 1 << 20)))
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Big")))
    conn.send(raw_frame(DATA, 0, 1, grpc_frame(b"100000")))  # over the connection's 65535 bytes
    assert goaway_codes(await conn.rest()) == [ENHANCE_YOUR_CALM]
    await p.served()


# --- 5. DATA: windows, short pieces ----------------------------------------------------------------


async def test_data_beyond_the_stream_window_is_a_flow_control_error(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Hold")))
    message = grpc_frame(b"\0" * ((1 << 20) - 5))  # the handler reads one; the rest wait unread,
    for _ in range(20):  # so no credit comes back once they fill half the window
        conn.send(raw_frame(DATA, 0, 1, message))
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 1, 0x3)  # FLOW_CONTROL_ERROR
    await p.served()


async def test_a_message_in_one_byte_data_frames_costs_its_bytes(peer: Callable[..., Any]) -> None:
    """20,000 DATA frames of one byte each of a message still incomplete: the server holds about
    the bytes, not a memoryview per frame (the old server: 200 bytes per frame); the no-work
    budget, which would end the connection first, is off here."""
    p: Peer = await peer(idle_frame_burst=0)
    conn = await p.connect()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Hold")))
    conn.send(raw_frame(DATA, 0, 1, struct.pack(">BL", 0, 100_000)))
    conn.send(raw_frame(PING, 0, 0, b"started!"))
    await conn.until(lambda fr: fr[0] == PING)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        conn.send(b"".join(raw_frame(DATA, 0, 1, b"x") for _ in range(20_000)))
        conn.send(raw_frame(PING, 0, 0, b"arrived!"))
        await conn.until(lambda fr: fr[0] == PING)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    call = p.connection().calls[1]
    assert call.rx_parts is not None and len(call.rx_parts) <= 2
    assert sum(map(len, call.rx_parts)) == 20_000
    assert held < 1 << 20, held


async def test_a_message_in_one_byte_frames_is_cut_by_the_no_work_budget(peer: Callable[..., Any]) -> None:
    """Parsing a frame costs the same whatever its size: slivers of a message still incomplete
    count as frames that do no work, so a flood of them ends the connection (the old server
    parsed millions of them and held the loop for seconds); a tenth of a PING each, a message may
    still come in 10,000 slivers at once (as h2's tests split them)."""
    p: Peer = await peer()
    before = limit_count("idle_frames")
    conn = await p.connect()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Hold")))
    conn.send(raw_frame(DATA, 0, 1, struct.pack(">BL", 0, 100_000)))
    conn.send(b"".join(raw_frame(DATA, 0, 1, b"x") for _ in range(20_000)))  # the default: 10,000
    # the connection ends (its GOAWAY may be lost to the reset of the unread rest) for this limit
    assert goaway_codes(await conn.rest()) in ([], [ENHANCE_YOUR_CALM])
    assert limit_count("idle_frames") == before + 1
    await p.served()


async def test_short_frames_that_complete_messages_are_work(peer: Callable[..., Any]) -> None:
    """1,500 tiny messages, each whole in its own frame, and one message in a few short pieces:
    all of it is work, nothing is cut."""
    p: Peer = await peer()
    conn = await p.connect()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Unary")))
    whole = grpc_frame(b"hello")
    conn.send(raw_frame(DATA, 0, 1, whole[:3]) + raw_frame(DATA, 0, 1, whole[3:7]))
    conn.send(raw_frame(DATA, END_STREAM, 1, whole[7:]))
    fields, _ = await read_response(conn, 1)
    assert fields["grpc-status"] == "0"
    conn.send(raw_frame(HEADERS, END_HEADERS, 3, request_block("/test.T/Hold")))
    conn.send(b"".join(raw_frame(DATA, 0, 3, grpc_frame(b"m")) for _ in range(1_500)))
    conn.send(raw_frame(PING, 0, 0, b"arrived!"))
    await conn.until(lambda fr: fr[0] == PING)
    assert 3 in p.connection().calls  # still open: the connection was not cut


# --- 6. HPACK table-size updates ----------------------------------------------------------------


@pytest.mark.parametrize("updates", [3, 2000])
async def test_over_two_table_size_updates_are_a_compression_error(
    peer: Callable[..., Any], updates: int
) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    block = b"\x20" * updates + request_block("/test.T/Unary")  # "size 0", again and again
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, block) + raw_frame(DATA, END_STREAM, 1, grpc_frame(b"")))
    assert goaway_codes(await conn.rest()) == [COMPRESSION_ERROR]


async def test_two_table_size_updates_are_taken(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    block = b"\x20\x3f\xe1\x1f" + request_block("/test.T/Unary")  # size 0, then 4096
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, block) + raw_frame(DATA, END_STREAM, 1, grpc_frame(b"a")))
    fields, _ = await read_response(conn, 1)
    assert fields["grpc-status"] == "0"


# --- 7. frames that do no work ------------------------------------------------------------------

NO_WORK = {
    "ping": raw_frame(PING, 0, 0, b"12345678"),
    "ping-ack": raw_frame(PING, 0x1, 0, b"12345678"),
    "settings": raw_frame(SETTINGS, 0, 0),
    "unknown-type": raw_frame(0x42, 0, 0, b"??"),
    "priority": raw_frame(PRIORITY, 0, 1, b"\0\0\0\0\x10"),
}


@pytest.mark.parametrize("frame", NO_WORK.values(), ids=NO_WORK.keys())
async def test_a_flood_of_frames_that_do_no_work_is_cut(peer: Callable[..., Any], frame: bytes) -> None:
    p: Peer = await peer()
    before = limit_count("idle_frames")
    conn = await p.connect()
    if frame[3] == PRIORITY:
        conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Hold")))
    conn.send(frame * 1500)  # the default budget: 1000 at once
    assert goaway_codes(await conn.rest()) == [ENHANCE_YOUR_CALM]
    assert limit_count("idle_frames") == before + 1
    await p.served()


async def test_a_flood_of_empty_data_frames_is_cut(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Hold")))
    conn.send(raw_frame(DATA, 0, 1, b"") * 1500)
    assert goaway_codes(await conn.rest()) == [ENHANCE_YOUR_CALM]


# --- 8. conformance ------------------------------------------------------------------------------

MALFORMED = {
    "uppercase-name": [("X-Upper", "1")],
    "connection-header": [("connection", "keep-alive")],
    "transfer-encoding": [("transfer-encoding", "chunked")],
    "te-not-trailers": [("te", "gzip")],
    "response-pseudo-header": [(":status", "200")],
    "unknown-pseudo-header": [(":protocol", "websocket")],
    "pseudo-after-regular": [(":method", "POST")],
    "newline-in-value": [("x-v", "a\nb")],
}


@pytest.mark.parametrize("extra", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_request_headers_reset_the_stream(
    peer: Callable[..., Any], extra: list[tuple[str, str]]
) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    base = [(":method", "POST"), (":scheme", "http"), (":path", "/test.T/Unary"), (":authority", "t")]
    fields = [*base, ("content-type", "application/grpc"), *extra]
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, Encoder().encode(fields)))
    conn.send(raw_frame(DATA, END_STREAM, 1, grpc_frame(b"x")))
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY, HEADERS))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 1, PROTOCOL_ERROR)
    conn.send(raw_frame(HEADERS, END_HEADERS, 3, request_block("/test.T/Unary")))  # the connection goes on
    conn.send(raw_frame(DATA, END_STREAM, 3, grpc_frame(b"ok")))
    fields_back, body = await read_response(conn, 3)
    assert fields_back["grpc-status"] == "0" and grpc_messages(body) == [b"re:ok"]


@pytest.mark.parametrize("missing", [":method", ":scheme", ":path"])
async def test_a_request_without_a_required_pseudo_header_resets_the_stream(
    peer: Callable[..., Any], missing: str
) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    base = [(":method", "POST"), (":scheme", "http"), (":path", "/test.T/Unary"), (":authority", "t")]
    fields = [(k, v) for k, v in base if k != missing] + [("content-type", "application/grpc")]
    conn.send(raw_frame(HEADERS, END_HEADERS | END_STREAM, 1, Encoder().encode(fields)))
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY, HEADERS))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 1, PROTOCOL_ERROR)


CONNECTION_ERRORS = {
    "rst-stream-on-stream-0": (rst(0), PROTOCOL_ERROR),
    "rst-stream-of-3-bytes": (raw_frame(RST_STREAM, 0, 1, b"\0\0\0"), FRAME_SIZE_ERROR),
    "rst-stream-on-idle-stream": (rst(5), PROTOCOL_ERROR),
    "window-update-on-idle-stream": (window_update(5, 10), PROTOCOL_ERROR),
    "priority-on-stream-0": (raw_frame(PRIORITY, 0, 0, b"\0\0\0\0\x10"), PROTOCOL_ERROR),
    "goaway-on-a-stream": (raw_frame(GOAWAY, 0, 1, struct.pack(">LL", 0, 0)), PROTOCOL_ERROR),
    "short-goaway": (raw_frame(GOAWAY, 0, 0, b"\0\0\0"), FRAME_SIZE_ERROR),
    "enable-push-2": (raw_frame(SETTINGS, 0, 0, struct.pack(">HL", 0x2, 2)), PROTOCOL_ERROR),
    "headers-priority-too-short": (raw_frame(HEADERS, END_HEADERS | 0x20, 1, b"\0\0"), FRAME_SIZE_ERROR),
}


@pytest.mark.parametrize(("frames", "code"), CONNECTION_ERRORS.values(), ids=CONNECTION_ERRORS.keys())
async def test_stream_0_idle_stream_and_length_errors(
    peer: Callable[..., Any], frames: bytes, code: int
) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    conn.send(frames)
    assert goaway_codes(await conn.rest()) == [code]


async def test_stream_errors_priority_length_and_self_dependency(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    conn.send(raw_frame(PRIORITY, 0, 1, b"\0\0\0\0"))  # 4 bytes: a stream error
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 1, FRAME_SIZE_ERROR)
    depends_on_itself = struct.pack(">LB", 3, 16) + request_block("/test.T/Unary")
    conn.send(raw_frame(HEADERS, END_HEADERS | END_STREAM | 0x20, 3, depends_on_itself))
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY, HEADERS))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 3, PROTOCOL_ERROR)


async def test_headers_on_a_half_closed_stream_is_stream_closed(peer: Callable[..., Any]) -> None:
    p: Peer = await peer()
    conn = await p.connect()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Hold")))
    conn.send(raw_frame(DATA, END_STREAM, 1, grpc_frame(b"x")))
    await until(lambda: p.probe.started.is_set())
    conn.send(raw_frame(HEADERS, END_HEADERS | END_STREAM, 1, Encoder().encode([("x-t", "1")])))
    got = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY))
    assert (got[0], got[2], rst_code(got)) == (RST_STREAM, 1, 0x5)  # STREAM_CLOSED


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="write_buffer_low"):
        Limits(write_buffer_low=2 << 20).check()
    with pytest.raises(ValueError, match="max_concurrent_streams"):
        Server(limits=Limits(max_concurrent_streams=0))


def test_serve_flags_default_to_the_limits_defaults() -> None:
    from epp.cli import _h2_limits, build_parser

    args = build_parser().parse_args(["serve"])
    assert _h2_limits(args) == Limits()
    args = build_parser().parse_args(["serve", "--h2-write-buffer-low", "0"])
    with pytest.raises(SystemExit, match="--h2-write-buffer-low"):
        _h2_limits(args)
