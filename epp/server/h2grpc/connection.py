"""One HTTP/2 connection of the gRPC server (an asyncio protocol): frames in, calls started per
stream, flow control both ways, replies coalesced into one write per event-loop turn."""

from __future__ import annotations

import asyncio
import re
import struct
from typing import Any, Protocol

import grpc
import structlog
from hpack import Decoder, HPACKError

from epp.log_limit import LOGS
from epp.server.h2grpc import frames as f
from epp.server.h2grpc import limits as lim
from epp.server.h2grpc.call import Call

log = structlog.get_logger("epp.h2grpc")

_U32 = struct.Struct(">L")
_PREFIX = struct.Struct(">BL")  # gRPC message prefix: compressed flag, length
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_HEADER_CACHE_SIZE = 64
_COPY_BELOW = 64 << 10  # messages shorter than this are copied out of the received bytes at once
_VIEW_FROM = 4 << 10  # pieces of a message shorter than this are copied (a view costs ~200 bytes)
# Request fields RFC 9113 section 8.2.2 forbids; pseudo-headers a request may carry (section 8.3.1).
_CONNECTION_HEADERS = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
_BAD_NAME = re.compile(rb"[^\x21-\x40\x5b-\x7e]")  # control, space, uppercase, DEL, non-ASCII
_BAD_VALUE = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")
_REQUIRED_PSEUDO = frozenset((b":method", b":scheme", b":path"))
_SELF_DEPENDENT = 0x100  # not a frame flag: the HEADERS frame's stream depends on itself


# A DATA frame shorter than this that leaves its message incomplete counts as no work (a message in
# 1-byte frames costs the parser per frame); a short frame that completes a message is work.
SHORT_DATA = 64
SHORT_DATA_COST = 0.1


class _ConnectionError(Exception):
    """A connection error (RFC 9113 section 5.4.1): GOAWAY with ``code``, then close; ``limit``: the
    limit of ``limits.py`` the peer went beyond, if that is the cause."""

    def __init__(self, code: int, message: str, limit: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.limit = limit


class _StreamError(Exception):
    """A stream error (RFC 9113 section 5.4.2): RST_STREAM with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Block:
    """A header block arriving in HEADERS then CONTINUATION frames: its pieces and running totals."""

    __slots__ = ("flags", "frames", "parts", "sid", "size")

    def __init__(self, sid: int, flags: int, first: bytes) -> None:
        self.sid = sid
        self.flags = flags
        self.parts = [first]
        self.size = len(first)
        self.frames = 1


def _request_error(fields: list[tuple[bytes, bytes]]) -> str:
    """Why a request's header fields are malformed (RFC 9113 sections 8.2 and 8.3), or ""."""
    seen: set[bytes] = set()
    regular = False
    for name, value in fields:
        if name[:1] == b":":
            if regular:
                return f"pseudo-header {name!r} after a regular field"
            if name not in _REQUEST_PSEUDO:
                return f"pseudo-header {name!r} in a request"
            if name in seen:
                return f"pseudo-header {name!r} twice"
            seen.add(name)
            if name == b":path" and not value:
                return "an empty :path"
            if _BAD_NAME.search(name, 1):
                return f"field name {name!r}"
        else:
            regular = True
            if not name or _BAD_NAME.search(name):
                return f"field name {name!r}"
            if name in _CONNECTION_HEADERS:
                return f"connection-specific field {name!r}"
            if name == b"te" and value != b"trailers":
                return "te other than trailers"
        if _BAD_VALUE.search(value):
            return f"the value of {name!r}"
    if not _REQUIRED_PSEUDO.issubset(seen):
        return "a request without :method, :scheme and :path"
    return ""


def _trailers_error(fields: list[tuple[bytes, bytes]]) -> str:
    """Why a client's trailers are malformed, or ""."""
    for name, value in fields:
        if name[:1] == b":":
            return f"pseudo-header {name!r} in trailers"
        if not name or _BAD_NAME.search(name) or name in _CONNECTION_HEADERS or _BAD_VALUE.search(value):
            return f"field {name!r}"
    return ""


def _timeout(value: bytes) -> float | None:
    """A ``grpc-timeout`` header value in seconds (None when malformed)."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def _keep(parts: list[memoryview | bytearray], piece: memoryview) -> None:
    """Add ``piece`` to the pieces of a message being received. A piece of some size that is not a
    sliver of the bytes it was read in stays a view of them (a long body is not copied); a short
    one is copied, joined to the short ones before it: a message in 1-byte DATA frames costs its
    bytes, not a view per byte, and a sliver never keeps a long read alive."""
    n = len(piece)
    if n >= _VIEW_FROM and n * 16 >= len(piece.obj):  # type: ignore[arg-type]
        parts.append(piece)
    elif parts and type(parts[-1]) is bytearray:
        parts[-1] += piece
    else:
        parts.append(bytearray(piece))


class Host(Protocol):
    """What a connection needs of its server."""

    loop: asyncio.AbstractEventLoop
    connections: set[Connection]
    max_receive_message_length: int
    max_send_message_length: int
    preface_timeout: float
    limits: lim.Limits

    def open_calls(self) -> int: ...

    def start_call(
        self,
        conn: Connection,
        sid: int,
        path: str,
        content_type: bytes,
        timeout: bytes,
        fields: list[tuple[bytes, bytes]],
        ended: int,
    ) -> None: ...


class Connection(asyncio.Protocol):
    """Server side of one HTTP/2 connection."""

    def __init__(self, server: Host) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: Any = None
        self.peer = ""
        self.calls: dict[int, Call] = {}
        self.last_sid = 0  # highest client stream id seen
        self.goaway_sent = False
        self.closed = False
        self._preface = True  # the client preface is still expected
        self._preface_timer: asyncio.TimerHandle | None = None
        self._pending: list[bytes] = []  # bytes of a frame not complete yet
        self._pending_len = 0
        self._need = 0
        self._continuation: _Block | None = None
        self._data_left = 0  # payload bytes of the DATA frame being received still to come
        self._data_call: Call | None = None  # where that frame's bytes go (None: dropped)
        self._data_flags = 0
        self._data_streamed = False
        self._decoder = Decoder()
        self._decoder.max_allowed_table_size = f.DEFAULT_HEADER_TABLE
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}  # header block -> fields
        # Flow control. Receiving: the connection window is credited back as DATA arrives; each
        # stream's as its messages are read (so what a slow handler holds stays bounded).
        self._recv_unacked = 0
        # Sending: the peer's windows and frame size.
        self.send_window = f.DEFAULT_WINDOW
        self.peer_initial_window = f.DEFAULT_WINDOW
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        self._out: list[bytes | memoryview] = []
        self._flush_scheduled = False
        self._paused: asyncio.Future[None] | None = None  # the transport's buffer is full
        self._window_waiters: set[Call] = set()
        self.limits = limits = server.limits
        now = self.loop.time()
        self._resets = lim.Bucket(limits.reset_burst, limits.reset_rate, now)
        self._idle_frames = lim.Bucket(limits.idle_frame_burst, limits.idle_frame_rate, now)
        self._stall_timer: asyncio.TimerHandle | None = None  # the socket does not drain

    # --- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}"
        else:
            self.peer = f"unix:{peer or ''}"
        server = self.server
        server.connections.add(self)
        limits = self.limits
        transport.set_write_buffer_limits(high=limits.write_buffer_high, low=limits.write_buffer_low)
        # A peer that never speaks HTTP/2 would hold the socket forever.
        self._preface_timer = self.loop.call_later(server.preface_timeout, self._preface_late)
        self._send(
            f.settings(
                {
                    f.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                    f.INITIAL_WINDOW_SIZE: f.STREAM_WINDOW,
                    f.MAX_FRAME_SIZE: f.RECV_MAX_FRAME,
                    f.MAX_HEADER_LIST_SIZE: limits.max_header_block_bytes,
                }
            )
            + f.window_update(0, f.CONNECTION_WINDOW - f.DEFAULT_WINDOW)
        )

    def _preface_late(self) -> None:
        if self._preface and not self.closed:
            self._fail(f.PROTOCOL_ERROR, f"no HTTP/2 client preface within {self.server.preface_timeout:g}s")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._preface_timer is not None:
            self._preface_timer.cancel()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        self.closed = True
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.cancel()
        self.calls.clear()
        paused = self._paused
        if paused is not None and not paused.done():
            paused.set_result(None)

    def pause_writing(self) -> None:
        """More than the write high-water mark is queued (replies, control frames, resets alike):
        reading stops, so a peer that does not read cannot make the server queue more; a socket
        that does not drain within the stall timeout closes the connection."""
        if self._paused is None:
            self._paused = self.loop.create_future()
            if not self.closed:
                self.transport.pause_reading()
                lim.hit(lim.WRITE_BUFFER, self.peer, "reading paused: the peer does not read")
                timeout = self.limits.write_stall_timeout
                if timeout:
                    self._stall_timer = self.loop.call_later(timeout, self._socket_stalled)

    def resume_writing(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        paused, self._paused = self._paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)
        if not self.closed:
            self.transport.resume_reading()

    def _socket_stalled(self) -> None:
        self._stall_timer = None
        if self._paused is not None and not self.closed:
            message = f"the peer read nothing for {self.limits.write_stall_timeout:g}s"
            self._fail(f.ENHANCE_YOUR_CALM, message, lim.WRITE_STALL)

    def data_received(self, data: bytes) -> None:
        try:
            pos = 0
            if self._data_left:  # the rest of a DATA frame's payload, passed on as it arrives
                take = min(self._data_left, len(data))
                self._data_piece(memoryview(data)[:take])
                self._data_left -= take
                if not self._data_left:
                    self._data_end()
                if take == len(data):
                    return
                pos = take
            if self._pending:
                self._pending.append(data[pos:] if pos else data)
                self._pending_len += len(data) - pos
                if self._pending_len < self._need:
                    return
                data, pos = b"".join(self._pending), 0
                self._pending = []
            self._frames(data, pos)
        except _ConnectionError as e:
            self._fail(e.code, str(e), e.limit)
        except HPACKError as e:
            self._fail(f.COMPRESSION_ERROR, f"header block: {e}")

    def _frames(self, data: bytes, pos: int) -> None:
        end = len(data)
        if self._preface:
            if end - pos < len(f.PREFACE):
                self._hold(data[pos:], len(f.PREFACE))
                return
            if data[pos : pos + len(f.PREFACE)] != f.PREFACE:
                raise _ConnectionError(f.PROTOCOL_ERROR, "not an HTTP/2 client preface")
            self._preface = False
            if self._preface_timer is not None:
                self._preface_timer.cancel()
            pos += len(f.PREFACE)
        view = memoryview(data)
        unpack = f.FRAME_HEADER.unpack_from
        while end - pos >= 9:
            hi, lo, kind, flags, sid = unpack(data, pos)
            length = (hi << 8) | lo
            if length > f.RECV_MAX_FRAME:
                raise _ConnectionError(f.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            sid &= 0x7FFFFFFF
            if self._continuation is not None and kind != f.CONTINUATION:
                raise _ConnectionError(f.PROTOCOL_ERROR, "a frame inside a header block")
            if end - pos - 9 < length:
                if kind == f.DATA and not flags & f.PADDED:  # a long one: its bytes go on as they come
                    self._data_start(flags, sid, length, streamed=True)
                    self._data_piece(view[pos + 9 :])
                    self._data_left = length - (end - pos - 9)
                    return
                break
            payload = view[pos + 9 : pos + 9 + length]
            pos += 9 + length
            if kind == f.DATA:
                self._data_start(flags, sid, length)
                if payload:
                    self._data_piece(self._unpad(flags, payload) if flags & f.PADDED else payload)
                    if length < SHORT_DATA and not flags & f.END_STREAM:
                        call = self._data_call
                        if call is not None and (call.rx_parts is not None or call.rx_head):
                            # a sliver of a message still incomplete: as cheap to send as a PING
                            # and as costly to parse; legal (a peer may split a message anyhow), so
                            # it costs a tenth of a frame that does no work: 10,000 at once
                            self._idle_frame("short DATA inside a message", SHORT_DATA_COST)
                elif not flags & f.END_STREAM:
                    self._idle_frame("empty DATA")
                self._data_end()
            elif kind == f.HEADERS:
                self._on_headers(flags, sid, payload)
            elif kind == f.CONTINUATION:
                self._on_continuation(flags, sid, payload)
            elif kind == f.WINDOW_UPDATE:
                self._on_window_update(sid, payload)
            elif kind == f.PING:
                if sid:
                    raise _ConnectionError(f.PROTOCOL_ERROR, "PING on a stream")
                if length != 8:
                    raise _ConnectionError(f.FRAME_SIZE_ERROR, "PING of another length than 8")
                self._idle_frame("PING")
                if not flags & f.ACK:
                    self._send(f.frame(f.PING, f.ACK, 0, bytes(payload)))
            elif kind == f.SETTINGS:
                self._on_settings(flags, sid, payload)
            elif kind == f.RST_STREAM:
                self._on_rst_stream(sid, length)
            elif kind == f.GOAWAY:
                if sid:
                    raise _ConnectionError(f.PROTOCOL_ERROR, "GOAWAY on a stream")
                if length < 8:
                    raise _ConnectionError(f.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
                self.goaway_sent = True  # no new stream is accepted; open calls finish
                self.close_when_idle()
            elif kind == f.PUSH_PROMISE:
                raise _ConnectionError(f.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            elif kind == f.PRIORITY:
                if sid == 0:
                    raise _ConnectionError(f.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    self._refuse(sid, f.FRAME_SIZE_ERROR)
                self._idle_frame("PRIORITY")
            else:  # unknown frame types are ignored (RFC 9113 section 4.1), within the budget
                self._idle_frame("a frame of an unknown type")
        if pos < end:
            rest = data[pos:]
            self._hold(rest, 9 + ((rest[0] << 16) | (rest[1] << 8) | rest[2]) if len(rest) >= 9 else 9)

    def _hold(self, rest: bytes, need: int) -> None:
        self._pending = [rest]
        self._pending_len = len(rest)
        self._need = need

    # --- frames ---------------------------------------------------------------------------------

    def _idle_frame(self, what: str, cost: float = 1.0) -> None:
        """A frame that does no work (nothing for a handler, nothing the server needed): within a
        budget per connection, as PINGs and SETTINGS from a healthy peer are; a flood of them
        ends the connection."""
        if not self._idle_frames.take(self.loop.time(), cost):
            raise _ConnectionError(
                f.ENHANCE_YOUR_CALM, f"too many frames that do no work ({what})", lim.IDLE_FRAMES
            )

    def _on_rst_stream(self, sid: int, length: int) -> None:
        if sid == 0:
            raise _ConnectionError(f.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if length != 4:
            raise _ConnectionError(f.FRAME_SIZE_ERROR, "RST_STREAM of another length than 4")
        call = self.calls.pop(sid, None)
        if call is None:
            if sid > self.last_sid:
                raise _ConnectionError(f.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            return
        if not call.headers_sent:  # reset before the server answered: what a Rapid Reset does
            self._count_reset()
        call.reset_by_client()

    def _count_reset(self) -> None:
        """A stream that cost the server a call and ended before it answered (reset by the client,
        or refused): within a budget per connection (CVE-2023-44487, Rapid Reset)."""
        if not self._resets.take(self.loop.time()):
            raise _ConnectionError(
                f.ENHANCE_YOUR_CALM, "too many streams reset or refused before an answer", lim.RESETS
            )

    def _on_settings(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid:
            raise _ConnectionError(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        self._idle_frame("SETTINGS")
        if flags & f.ACK:
            if payload:
                raise _ConnectionError(f.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(f.FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == f.ENABLE_PUSH:
                if value > 1:
                    raise _ConnectionError(f.PROTOCOL_ERROR, "ENABLE_PUSH other than 0 or 1")
            elif key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise _ConnectionError(f.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.calls.values():
                    call.send_window += delta
                if delta > 0:
                    self._wake_writers()
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= f.MAX_FRAME_LIMIT:
                    raise _ConnectionError(f.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            # HEADER_TABLE_SIZE: the server's header blocks never use the dynamic table.
        self._send(f.frame(f.SETTINGS, f.ACK, 0))

    def _on_window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(f.FRAME_SIZE_ERROR, "WINDOW_UPDATE of another length than 4")
        increment = _U32.unpack_from(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise _ConnectionError(f.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > f.MAX_WINDOW:
                raise _ConnectionError(f.FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._wake_writers()
            return
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid:
                raise _ConnectionError(f.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            self._idle_frame("WINDOW_UPDATE of a closed stream")
            return
        if increment == 0 or call.send_window + increment > f.MAX_WINDOW:
            self._reset(call, f.FLOW_CONTROL_ERROR if increment else f.PROTOCOL_ERROR)
            return
        call.send_window += increment
        call.wake_writer()

    def _on_headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise _ConnectionError(f.PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload)
        if flags & f.PRIORITY_FLAG:
            if len(block) < 5:
                raise _ConnectionError(f.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            depends = _U32.unpack_from(block)[0] & 0x7FFFFFFF
            block = block[5:]
            if depends == sid:  # a stream error, once the block is decoded (the table must follow)
                flags |= _SELF_DEPENDENT
        if len(block) > self.limits.max_header_block_bytes:
            raise self._block_too_large()
        if flags & f.END_HEADERS:
            self._header_block(sid, flags, bytes(block))
        else:
            self._continuation = _Block(sid, flags, bytes(block))

    def _block_too_large(self) -> _ConnectionError:
        return _ConnectionError(
            f.ENHANCE_YOUR_CALM,
            f"header block over {self.limits.max_header_block_bytes} bytes",
            lim.HEADER_BLOCK_BYTES,
        )

    def _on_continuation(self, flags: int, sid: int, payload: memoryview) -> None:
        block = self._continuation
        if block is None or block.sid != sid:
            raise _ConnectionError(f.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block.frames += 1  # empty frames count too: each costs a frame's work
        if block.frames > self.limits.max_header_block_frames:
            raise _ConnectionError(
                f.ENHANCE_YOUR_CALM,
                f"header block in over {self.limits.max_header_block_frames} frames",
                lim.HEADER_BLOCK_FRAMES,
            )
        block.size += len(payload)
        if block.size > self.limits.max_header_block_bytes:
            raise self._block_too_large()
        block.parts.append(bytes(payload))
        if flags & f.END_HEADERS:
            self._continuation = None
            self._header_block(sid, block.flags, b"".join(block.parts))

    def _unpad(self, flags: int, payload: memoryview) -> memoryview:
        if not flags & f.PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise _ConnectionError(f.PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]

    def _decode(self, block: bytes, request: bool) -> list[tuple[bytes, bytes]]:
        """The block's fields; _StreamError when a request's are malformed (RFC 9113 section 8).
        A request block decoded while the dynamic table stayed as it is decodes the same way again
        (a client's repeated request headers are indexed fields), so it is cached, checked."""
        entries = self._decoder.header_table.dynamic_entries
        if request:
            cached = self._decoded.get(block)  # every cached block was decoded with the table as it is
            if cached is not None:
                return cached
        if block[:1] and block[0] & 0xE0 == 0x20:
            self._table_updates(block)
        # Entries are only added at the front (a new tuple) and evicted at the back, so the same
        # length and the same front entry (held here: its id cannot be reused) mean the same table.
        size, first = len(entries), entries[0] if entries else None
        fields: list[tuple[bytes, bytes]] = self._decoder.decode(block, raw=True)  # type: ignore[assignment]
        same = len(entries) == size and (entries[0] if entries else None) is first
        if not same:
            self._decoded.clear()  # the table changed: a cached block may mean other fields now
        error = _request_error(fields) if request else _trailers_error(fields)
        if error:
            raise _StreamError(f.PROTOCOL_ERROR, error)
        if same and request and len(self._decoded) < _HEADER_CACHE_SIZE:
            self._decoded[block] = fields
        return fields

    def _table_updates(self, block: bytes) -> None:
        """At most two dynamic table size updates, at the start of the block (RFC 7541 section
        4.2; hpack itself refuses one after a field)."""
        pos = count = 0
        while pos < len(block) and block[pos] & 0xE0 == 0x20:
            count += 1
            if count > 2:
                raise _ConnectionError(
                    f.COMPRESSION_ERROR,
                    "over 2 table size updates in a header block",
                    lim.HPACK_TABLE_UPDATES,
                )
            pos += 1
            if block[pos - 1] & 0x1F == 0x1F:  # a multi-byte integer: continuation bytes
                while pos < len(block) and block[pos] & 0x80:
                    pos += 1
                pos += 1

    def _refuse(self, sid: int, code: int) -> None:
        """A stream error on ``sid``: its call (if any) reset, else only RST_STREAM."""
        call = self.calls.get(sid)
        if call is not None:
            self._reset(call, code)
        else:
            self._send(f.rst_stream(sid, code))

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        call = self.calls.get(sid)
        new = call is None and sid > self.last_sid
        try:
            fields = self._decode(block, new)  # decoded even for a refused stream: the table must follow
        except _StreamError as e:
            if sid % 2 == 0:
                raise _ConnectionError(f.PROTOCOL_ERROR, f"stream id {sid} not a client stream") from None
            if call is None:
                if not new:
                    return  # a stream the server already ended
                self.last_sid = sid
            lim.hit(lim.MALFORMED_HEADERS, self.peer, str(e), stream=sid)
            self._count_reset()
            self._refuse(sid, e.code)
            return
        if call is not None:  # trailers from the client end its stream
            if call.remote_closed:
                self._reset(call, f.STREAM_CLOSED)
            elif not flags & f.END_STREAM:
                self._reset(call, f.PROTOCOL_ERROR)
            else:
                call.end_remote()
            return
        if sid % 2 == 0:
            raise _ConnectionError(f.PROTOCOL_ERROR, f"stream id {sid} not a client stream")
        if sid <= self.last_sid:  # a stream the server already ended (trailers in flight): ignored
            return
        self.last_sid = sid
        if flags & _SELF_DEPENDENT:
            self._refuse(sid, f.PROTOCOL_ERROR)
            return
        limits = self.limits
        if self.goaway_sent or len(self.calls) >= limits.max_concurrent_streams:
            if not self.goaway_sent:
                lim.hit(lim.STREAMS, self.peer, f"over {limits.max_concurrent_streams} streams")
            self._count_reset()
            self._send(f.rst_stream(sid, f.REFUSED_STREAM))
            return
        if self.server.open_calls() >= limits.max_open_calls:
            lim.hit(lim.OPEN_CALLS, self.peer, f"over {limits.max_open_calls} open calls in the process")
            self._count_reset()
            self._send(f.rst_stream(sid, f.REFUSED_STREAM))
            return
        path = content_type = timeout = b""
        for name, value in fields:  # what the server itself reads; the rest only if a handler asks
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
        self.server.start_call(
            self, sid, path.decode("ascii", "replace"), content_type, timeout, fields, flags & f.END_STREAM
        )

    def _data_start(self, flags: int, sid: int, length: int, streamed: bool = False) -> None:
        """A DATA frame of ``length`` payload bytes begins (its pieces follow, then ``_data_end``);
        ``streamed``: the pieces arrive over several reads, each counted in the stream's window
        as it comes (so credit is never given for bytes still on their way)."""
        self._recv_unacked += length  # padding counts in flow control
        if self._recv_unacked > f.CONNECTION_WINDOW:
            raise _ConnectionError(
                f.FLOW_CONTROL_ERROR, "DATA beyond the connection window", lim.FLOW_CONTROL
            )
        if self._recv_unacked >= f.CONNECTION_WINDOW // 2:
            self._send(f.window_update(0, self._recv_unacked))
            self._recv_unacked = 0
        self._data_flags = flags
        call = self._data_call = self.calls.get(sid)
        if call is None:
            if sid == 0 or sid > self.last_sid:
                raise _ConnectionError(f.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream the server ended or reset: frames still in flight are ignored
        if call.remote_closed:
            self._data_call = None
            self._reset(call, f.STREAM_CLOSED)
            return
        if call.unacked + length > f.STREAM_WINDOW:
            lim.hit(lim.FLOW_CONTROL, self.peer, "DATA beyond the stream window", stream=sid)
            self._data_call = None
            self._reset(call, f.FLOW_CONTROL_ERROR)
            return
        self._data_streamed = streamed
        if not streamed:
            call.unacked += length

    def _data_piece(self, data: memoryview) -> None:
        call = self._data_call
        if call is None or not data:
            return
        if self._data_streamed:
            call.unacked += len(data)
        error = self._messages(call, data)
        if error is not None:
            self._data_call = None
            self._reset(call, f.CANCEL, error)

    def _data_end(self) -> None:
        call, self._data_call = self._data_call, None
        if call is None:
            return
        if self._data_flags & f.END_STREAM:
            if call.rx_parts is not None or call.rx_head:
                self._reset(call, f.CANCEL, (grpc.StatusCode.INTERNAL, "stream ended inside a message"))
                return
            call.end_remote()
        if call.unacked >= f.CREDIT_FROM:
            self.credit(call)

    def _messages(self, call: Call, data: memoryview) -> tuple[grpc.StatusCode, str] | None:
        """Split ``data`` into the call's gRPC messages; a status to end the call with on a bad one."""
        pos, end = 0, len(data)
        if call.rx_parts is not None:  # completing a message
            take = min(call.rx_need, end)
            _keep(call.rx_parts, data[:take])
            call.rx_need -= take
            pos = take
            if call.rx_need == 0:
                parts, call.rx_parts = call.rx_parts, None
                call.deliver(
                    [p if type(p) is memoryview else memoryview(p) for p in parts], sum(map(len, parts))
                )
        if call.rx_head and pos < end:  # a prefix split across frames
            data = memoryview(call.rx_head + bytes(data[pos:]))
            call.rx_head = b""
            pos, end = 0, len(data)
        limit = self.server.max_receive_message_length
        while pos < end:
            if end - pos < 5:
                call.rx_head = bytes(data[pos:])
                return None
            compressed, length = _PREFIX.unpack_from(data, pos)
            if compressed:
                return grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported"
            if length > limit:
                return (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({length} vs. {limit})",
                )
            pos += 5
            if end - pos >= length:
                if length < _COPY_BELOW or length * 16 < len(data.obj):  # type: ignore[arg-type]
                    call.deliver(bytes(data[pos : pos + length]), length)
                else:  # a long message in one frame: left in place, a piece decoder copies what it keeps
                    call.deliver([data[pos : pos + length]], length)
                pos += length
            else:
                call.rx_parts = []
                _keep(call.rx_parts, data[pos:])
                call.rx_need = length - (end - pos)
                return None
        return None

    def credit(self, call: Call) -> None:
        """Give the stream's window back once a quarter of it is used (no WINDOW_UPDATE per
        message), unless messages not read yet fill half of it (then ``read`` calls again)."""
        if call.remote_closed or call.unacked < f.CREDIT_FROM:
            return
        if call.inbox_bytes < f.STREAM_WINDOW // 2:
            self._send(f.window_update(call.sid, call.unacked))
            call.unacked = 0

    # --- sending --------------------------------------------------------------------------------

    def _send(self, *parts: bytes | memoryview) -> None:
        """Queue bytes for this loop turn's single write (joined there: a message's bytes are
        copied once, into that write)."""
        self._out.extend(parts)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if self.closed or not out:
            return
        self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    async def send_message(self, call: Call, data: bytes) -> None:
        """One gRPC message on ``call``'s stream, within the flow-control windows."""
        if call.reset or self.closed:
            raise asyncio.CancelledError("the stream was reset")
        size = len(data)
        if size > self.server.max_send_message_length:
            raise ValueError(f"message of {size} bytes over the send limit")
        if not call.headers_sent:
            call.headers_sent = True
            self._send(f.frame(f.HEADERS, f.END_HEADERS, call.sid, f.RESPONSE_HEADERS))
        prefix = _PREFIX.pack(0, size)
        total = size + 5
        if total <= self.send_window and total <= call.send_window and total <= self.peer_max_frame:
            self.send_window -= total
            call.send_window -= total
            self._send(f.frame_header(f.DATA, 0, call.sid, total), prefix, data)
        else:
            await self._send_chunked(call, prefix, memoryview(data))
        if self._paused is not None:
            await self._paused

    async def _send_chunked(self, call: Call, prefix: bytes, view: memoryview) -> None:
        """The message (``prefix`` then ``view``) in DATA frames as the windows and the peer's
        frame size allow."""
        pos, end = -len(prefix), len(view)  # pos < 0: within the prefix
        while pos < end:
            allowed = min(self.send_window, call.send_window, self.peer_max_frame, end - pos)
            if allowed <= 0:
                timeout = self.limits.write_stall_timeout
                since = self.loop.time()
                call.window_waiter = self.loop.create_future()  # no local: see Call.read
                self._window_waiters.add(call)
                timer = self.loop.call_later(timeout, call.wake_writer) if timeout else None
                try:
                    await call.window_waiter
                finally:
                    call.window_waiter = None
                    self._window_waiters.discard(call)
                    if timer is not None:
                        timer.cancel()
                if call.reset or self.closed:
                    raise asyncio.CancelledError("the stream was reset")
                if (
                    timeout
                    and self.loop.time() - since >= timeout
                    and (self.send_window <= 0 or call.send_window <= 0)
                ):
                    self._write_stalled(call, timeout)
                continue
            self.send_window -= allowed
            call.send_window -= allowed
            header = f.frame_header(f.DATA, 0, call.sid, allowed)
            if pos < 0:
                head = prefix[len(prefix) + pos : len(prefix) + pos + allowed]
                self._send(header, head, view[: allowed - len(head)])
            else:
                self._send(header, view[pos : pos + allowed])
            pos += allowed

    def _write_stalled(self, call: Call, timeout: float) -> None:
        """A reply waited ``timeout`` for flow-control credit: the stream is reset (CANCEL), or the
        connection closed when its own window is the one the peer leaves shut."""
        message = f"no flow-control credit for {timeout:g}s"
        if self.send_window <= 0:
            self._fail(f.ENHANCE_YOUR_CALM, message, lim.WRITE_STALL)
        else:
            lim.hit(lim.WRITE_STALL, self.peer, message, stream=call.sid)
            self._reset(call, f.CANCEL)
        raise asyncio.CancelledError("the stream was reset")

    def _wake_writers(self) -> None:
        for call in list(self._window_waiters):
            call.wake_writer()

    def end_call(self, call: Call, code: grpc.StatusCode, details: str) -> None:
        """The handler finished: the status in trailers (or a trailers-only response)."""
        if call.deadline is not None:
            call.deadline.cancel()
        if self.calls.get(call.sid) is not call or call.reset or self.closed:
            if self.calls.get(call.sid) is call:
                del self.calls[call.sid]
            self.close_when_idle()
            return
        del self.calls[call.sid]
        ok = code is grpc.StatusCode.OK and not details
        status = f.OK_TRAILERS if ok else f.status_fields(code.value[0], details)
        block = status if call.headers_sent else f.RESPONSE_HEADERS + status
        out = f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, call.sid, block)
        if not call.remote_closed:  # the client may stop sending: the response is complete
            out += f.rst_stream(call.sid, f.NO_ERROR)
        self._send(out)
        self.close_when_idle()

    def _reset(self, call: Call, code: int, status: tuple[grpc.StatusCode, str] | None = None) -> None:
        """End ``call`` from the server side: a status when the client can still read one, else
        RST_STREAM; the handler is cancelled either way."""
        self.calls.pop(call.sid, None)
        if status is not None and not call.reset:
            block = f.status_fields(status[0].value[0], status[1])
            if not call.headers_sent:
                block = f.RESPONSE_HEADERS + block
            self._send(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, call.sid, block))
            code = f.NO_ERROR  # the status ends the call; any other code would override it (CANCELLED)
        self._send(f.rst_stream(call.sid, code))
        call.cancel()

    # --- connection ends ------------------------------------------------------------------------

    def goaway(self) -> None:
        """Graceful shutdown: no new streams; the open ones finish."""
        if not self.goaway_sent and not self.closed:
            self.goaway_sent = True
            self._send(f.goaway(self.last_sid, f.NO_ERROR))
        self.close_when_idle()

    def close_when_idle(self) -> None:
        if self.goaway_sent and not self.calls and not self.closed:
            self.loop.call_soon(self._close)

    def _close(self) -> None:
        if not self.closed:
            self._flush()
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        """Hard stop: every call cancelled, the connection closed."""
        for call in list(self.calls.values()):
            call.cancel()
        self.calls.clear()
        if not self.closed:
            self._flush()
            self.closed = True
            self.transport.close()

    def _fail(self, code: int, message: str, limit: str = "") -> None:
        if limit:
            lim.hit(limit, self.peer, message)
        else:
            LOGS.log(
                log.warning, "h2_connection_error", "HTTP/2 connection error", error=message, peer=self.peer
            )
        if not self.closed:
            self._send(f.goaway(self.last_sid, code, message.encode()[:256]))
            self.abort()
