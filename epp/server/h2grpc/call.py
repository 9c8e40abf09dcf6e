"""One gRPC call on an HTTP/2 stream: its inbound messages, its replies, and the server-side
context a handler sees (``read``, ``write``, ``abort``: the subset of ``grpc.aio.ServicerContext``
the EPP's services use)."""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import grpc

from epp.server.h2grpc.frames import CREDIT_FROM

EOF = grpc.aio.EOF
_TRANSPORT_HEADERS = frozenset({"content-type", "te"})


class Stream(Protocol):
    """What a call needs of its connection."""

    loop: asyncio.AbstractEventLoop
    peer: str

    def credit(self, call: Call) -> None: ...

    async def send_message(self, call: Call, data: bytes) -> None: ...

    def end_call(self, call: Call, code: grpc.StatusCode, details: str) -> None: ...


class AbortError(Exception):
    """Raised by ``Call.abort``: the handler ends and the status is sent."""


class Call:
    """Server side of one stream: the handler's context and the stream's state."""

    __slots__ = (
        "_decode_pieces",
        "_deserialize",
        "_serialize",
        "code",
        "conn",
        "deadline",
        "deadline_exceeded",
        "details",
        "fields",
        "headers_sent",
        "inbox",
        "inbox_bytes",
        "method",
        "remote_closed",
        "reset",
        "rx_head",
        "rx_need",
        "rx_parts",
        "send_window",
        "sid",
        "started",
        "task",
        "unacked",
        "waiter",
        "window_waiter",
    )

    def __init__(
        self,
        conn: Stream,
        sid: int,
        method: str,
        fields: list[tuple[bytes, bytes]],
        deserialize: Callable[[bytes], Any] | None,
        serialize: Callable[[Any], bytes] | None,
        send_window: int,
        decode_pieces: Callable[[list[memoryview]], Any] | None = None,
    ) -> None:
        self.conn = conn
        self.sid = sid
        self.method = method
        self.fields = fields  # the request's header fields as decoded (HPACK)
        self._deserialize = deserialize
        self._decode_pieces = decode_pieces  # for a message received in several pieces
        self._serialize = serialize
        # Complete messages not read yet: bytes, or the pieces of one that arrived in several.
        self.inbox: deque[bytes | list[memoryview]] = deque()
        self.inbox_bytes = 0
        self.waiter: asyncio.Future[None] | None = None  # a read waiting for a message
        self.window_waiter: asyncio.Future[None] | None = None  # a write waiting for flow control
        self.remote_closed = False  # the client half-closed (END_STREAM)
        self.reset = False  # the stream is gone (RST_STREAM either way, or the connection)
        self.headers_sent = False
        self.send_window = send_window
        self.unacked = 0  # DATA bytes received and not yet credited back (stream window)
        self.rx_parts: list[memoryview | bytearray] | None = None  # pieces of a message being received
        self.rx_need = 0  # bytes that message still lacks
        self.rx_head = b""  # a message prefix split across DATA frames
        self.task: asyncio.Task[None] | None = None
        self.started = False  # the task began running the handler
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.deadline: asyncio.TimerHandle | None = None
        self.deadline_exceeded = False

    # --- grpc.aio.ServicerContext ---------------------------------------------------------------

    async def read(self) -> Any:
        """The next request message, or ``EOF`` once the client half-closed."""
        inbox = self.inbox
        if not inbox:
            if self.remote_closed:
                return EOF
            # No local holds the future: a cancellation's traceback keeps this frame, and the future
            # keeps that exception (a cycle that only a full collection would free).
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
            if not inbox:
                return EOF
        data = inbox.popleft()
        self.inbox_bytes -= sum(map(len, data)) if isinstance(data, list) else len(data)
        if self.unacked >= CREDIT_FROM:
            self.conn.credit(self)
        if isinstance(data, list):
            if self._decode_pieces is not None:
                return self._decode_pieces(data)
            message = b"".join(data)
        else:
            message = data
        deserialize = self._deserialize
        return deserialize(message) if deserialize is not None else message

    async def write(self, message: Any) -> None:
        serialize = self._serialize
        data = serialize(message) if serialize is not None else message
        await self.conn.send_message(self, data)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        self.code, self.details = code, details
        raise AbortError(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The client's metadata as grpc gives it: no pseudo-headers or transport headers
        (``content-type``, ``te``, ``grpc-*``), ``-bin`` values decoded from base64."""
        out: list[tuple[str, str | bytes]] = []
        for raw_name, raw_value in self.fields:
            name = raw_name.decode("ascii", "replace")
            if name[:1] == ":" or name in _TRANSPORT_HEADERS or name.startswith("grpc-"):
                continue
            if name.endswith("-bin"):
                try:
                    out.append((name, base64.b64decode(raw_value + b"=" * (-len(raw_value) % 4))))
                except binascii.Error:
                    continue
            else:
                out.append((name, raw_value.decode("utf-8", "replace")))
        return tuple(out)

    def use(
        self, deserialize: Callable[[bytes], Any] | None, serialize: Callable[[Any], bytes] | None
    ) -> None:
        """The handler's (de)serializers, once a generic handler was found for the call."""
        self._deserialize, self._serialize = deserialize, serialize

    def peer(self) -> str:
        return self.conn.peer

    def cancelled(self) -> bool:
        return self.reset or self.deadline_exceeded

    def done(self) -> bool:
        return self.task is None or self.task.done()

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline.when() - self.conn.loop.time())

    # --- request iterator (the handlers' first argument) ----------------------------------------

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        message = await self.read()
        if message is EOF:
            raise StopAsyncIteration
        return message

    # --- driven by the connection ---------------------------------------------------------------

    def deliver(self, data: bytes | list[memoryview], size: int) -> None:
        """A complete message (``size`` bytes): its bytes, or its pieces in order."""
        self.inbox.append(data)
        self.inbox_bytes += size
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def end_remote(self) -> None:
        self.remote_closed = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wake_writer(self) -> None:
        waiter = self.window_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel(self) -> None:
        """The stream is gone: the handler is cancelled (a client cancellation to the handler)."""
        self.reset = True
        self.wake_writer()
        self._cancel_task()

    def _cancel_task(self) -> None:
        """Cancel the handler's task once it runs. One that has not run yet is left to see
        ``reset`` and end at its first step: cancelling it would end it with a CancelledError
        whose traceback holds the call that holds the task (a cycle only a full collection frees,
        a Rapid Reset's worth per second)."""
        task = self.task
        if task is not None and self.started and not task.done():
            task.cancel()

    def reset_by_client(self) -> None:
        """RST_STREAM from the client. A handler waiting in ``read`` after the client's END_STREAM
        (Envoy half-closes, then resets, in one go) reads EOF and ends as it would have a moment
        earlier; any other is cancelled. Either way nothing more can be sent."""
        if self.remote_closed and not self.inbox and self.waiter is not None:
            self.reset = True
            self.wake_writer()
            return
        self.cancel()

    def expire(self) -> None:
        """The client's ``grpc-timeout`` elapsed."""
        self.deadline_exceeded = True
        self._cancel_task()
