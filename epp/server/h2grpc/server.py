"""The server: listening sockets (TCP, Unix, TLS), the method table, one task per call, graceful
stop. It takes the handlers ``grpc`` builds (``grpc.stream_stream_rpc_method_handler`` and the
generated ``add_..._to_server`` functions) as ``grpc.aio.Server`` does."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import ssl
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from epp.log_limit import LOGS
from epp.server.h2grpc.call import AbortError, Call
from epp.server.h2grpc.connection import Connection, _timeout
from epp.server.h2grpc.limits import Limits

log = structlog.get_logger("epp.h2grpc")

_EOF = grpc.aio.EOF


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


class Server:
    """A gRPC server over HTTP/2, written for one hot stream-stream method.

    Per call it costs one task and the frames themselves: header blocks a client repeats decode
    from a cache, replies of one event-loop turn leave in one write, flow-control credit is sent
    only every quarter window. Bind with ``add_insecure_port`` / ``add_secure_port`` (an
    ``ssl.SSLContext``; ALPN ``h2`` is set), then ``start()``; ``stop(grace)`` sends GOAWAY, lets
    open calls finish for ``grace`` seconds and cancels the rest.
    """

    def __init__(
        self,
        *,
        max_receive_message_length: int = 4 << 20,
        max_send_message_length: int = 64 << 20,
        preface_timeout: float = 20.0,
        limits: Limits | None = None,
    ) -> None:
        self.max_receive_message_length = max_receive_message_length
        self.max_send_message_length = max_send_message_length
        self.limits = limits = limits or Limits()
        limits.check()
        self.preface_timeout = preface_timeout  # a connection silent this long after it opened is closed
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self.connections: set[Connection] = set()
        self._methods: dict[str, grpc.RpcMethodHandler] = {}
        self._piece_decoders: dict[str, Callable[[list[memoryview]], Any]] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._sockets: list[tuple[socket.socket, ssl.SSLContext | None]] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._unix_paths: list[str] = []
        self._calls: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()

    # --- registration (the grpc.aio.Server calls the generated code makes) ----------------------

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        for name, handler in handlers.items():
            self._methods[f"/{service}/{name}"] = handler

    def add_piece_decoder(self, method: str, decode: Callable[[list[memoryview]], Any]) -> None:
        """Messages of ``method`` (``/service/Method``) that arrive in several pieces (a long one
        over several reads) go to ``decode`` as those pieces instead of being joined and handed to
        the request deserializer: it can copy only what it keeps."""
        self._piece_decoders[method] = decode

    def _generic_handler(
        self, path: str, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> grpc.RpcMethodHandler | None:
        for generic in self._generic:
            handler = generic.service(_CallDetails(path, metadata))
            if handler is not None:
                return handler
        return None

    # --- sockets --------------------------------------------------------------------------------

    def add_insecure_port(self, address: str) -> int:
        return self._bind(address, None)

    def add_secure_port(self, address: str, context: ssl.SSLContext) -> int:
        context.set_alpn_protocols(["h2"])
        return self._bind(address, context)

    def _bind(self, address: str, context: ssl.SSLContext | None) -> int:
        """Bind now (an address in use fails here, as with grpc); the port bound."""
        if address.startswith("unix:"):
            path = address[5:]
            if os.path.exists(path) and _stale_socket(path):
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _bind_or_fail(sock, path, address)
            self._unix_paths.append(path)
            self._sockets.append((sock, context))
            return 0
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "::"
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("::", "[::]"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        _bind_or_fail(sock, sockaddr, address)
        self._sockets.append((sock, context))
        return int(sock.getsockname()[1])

    async def start(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        for sock, context in self._sockets:
            sock.listen(1024)
            sock.setblocking(False)
            server = await loop.create_server(lambda: Connection(self), sock=sock, ssl=context, backlog=1024)
            self._servers.append(server)

    # --- calls ----------------------------------------------------------------------------------

    def open_calls(self) -> int:
        """Calls whose handler runs (or is about to), across connections."""
        return len(self._calls)

    def start_call(
        self,
        conn: Connection,
        sid: int,
        path: str,
        content_type: bytes,
        timeout: bytes,
        fields: list[tuple[bytes, bytes]],
        ended: int,
    ) -> None:
        handler = self._methods.get(path)
        call = Call(
            conn,
            sid,
            path,
            fields,
            handler.request_deserializer if handler is not None else None,
            handler.response_serializer if handler is not None else None,
            conn.peer_initial_window,
            self._piece_decoders.get(path),
        )
        if handler is None and self._generic:
            handler = self._generic_handler(path, call.invocation_metadata())
            if handler is not None:
                call.use(handler.request_deserializer, handler.response_serializer)
        conn.calls[sid] = call
        if ended:
            call.end_remote()
        if not content_type.startswith(b"application/grpc"):
            shown = content_type.decode("ascii", "replace")
            conn.end_call(call, grpc.StatusCode.INTERNAL, f"invalid content-type: {shown!r}")
            return
        if handler is None:
            conn.end_call(call, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
            return
        if timeout:
            seconds = _timeout(timeout)
            if seconds is not None:
                call.deadline = self.loop.call_later(seconds, call.expire)
        task = call.task = self.loop.create_task(self._run(call, handler))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run(self, call: Call, handler: grpc.RpcMethodHandler) -> None:
        if call.reset or call.deadline_exceeded:  # ended before the task ran: see Call._cancel_task
            call.task = None
            code = grpc.StatusCode.DEADLINE_EXCEEDED if call.deadline_exceeded else grpc.StatusCode.CANCELLED
            call.conn.end_call(call, code, "Deadline Exceeded" if call.deadline_exceeded else "")
            return
        call.started = True
        code, details = grpc.StatusCode.OK, ""
        try:
            if handler.stream_stream is not None:
                await handler.stream_stream(call, call)
            elif handler.unary_unary is not None:
                await call.write(await handler.unary_unary(await self._single(call), call))
            elif handler.unary_stream is not None:
                await self._stream_out(call, handler.unary_stream(await self._single(call), call))
            else:
                await call.write(await handler.stream_unary(call, call))
            code, details = call.code, call.details
        except AbortError:
            code, details = call.code, call.details
        except asyncio.CancelledError:
            # The stream is gone (or the server stops, or the deadline passed). Not re-raised: the
            # task would keep the exception, whose traceback holds this frame and the call.
            if call.deadline_exceeded:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            else:
                code, details = grpc.StatusCode.CANCELLED, ""
        except Exception as e:
            LOGS.log(log.exception, "h2grpc_handler_failed", "gRPC handler failed", method=call.method)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"
        finally:
            call.task = None
        call.conn.end_call(call, code, details)

    @staticmethod
    async def _single(call: Call) -> Any:
        message = await call.read()
        if message is _EOF:
            await call.abort(grpc.StatusCode.INTERNAL, "the request message is missing")
        return message

    @staticmethod
    async def _stream_out(call: Call, result: Any) -> None:
        if inspect.isasyncgen(result):
            async for message in result:
                await call.write(message)
        elif inspect.isawaitable(result):
            await result

    # --- stop -----------------------------------------------------------------------------------

    async def stop(self, grace: float | None) -> None:
        """Stop listening, GOAWAY every connection, let calls finish within ``grace`` seconds,
        then cancel what is left and close the connections."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.goaway()
        if grace and self._calls:
            await asyncio.wait(set(self._calls), timeout=grace)
        for conn in list(self.connections):
            conn.abort()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=1.0)
        for path in self._unix_paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        for sock, _ in self._sockets:
            sock.close()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


def _bind_or_fail(sock: socket.socket, where: Any, address: str) -> None:
    """Bind ``sock``; an address in use fails as grpc's servers fail (RuntimeError)."""
    try:
        sock.bind(where)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"Failed to bind to address {address}: {e.strerror}") from None


def _stale_socket(path: str) -> bool:
    """Whether the Unix socket at ``path`` has no listener (left by a process that died)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False
