"""epp.server.h2grpc, the ext_proc port's gRPC server, against real peers: grpc's own client
(grpc.aio) for what a gRPC client does, python-hyper's h2 and raw frames for what it never does."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import socket
import ssl
import struct
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple

from epp.server.h2grpc import Call, Server
from epp.server.h2grpc.frames import CREDIT_FROM
from epp.server.tls import Authority, KeyPair, server_ssl_context

T = 10.0  # bounds every wait: a hung test fails instead of hanging the suite
BIG = 16 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", BIG), ("grpc.max_send_message_length", BIG)]
DETAILS = "näh: 100% sure"
OK = grpc.StatusCode.OK


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ per position (a dropped or repeated chunk shows)."""
    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------------------ the test service


@dataclass
class Probe:
    """What the handlers saw: a test waits on these instead of sleeping."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # echo saw the end of the requests
    seen: dict[str, Any] = field(default_factory=dict)


def service(p: Probe) -> dict[str, grpc.RpcMethodHandler]:
    """Bytes in, bytes out (no serializers): ``/test.T/<name>``."""

    async def echo(requests: AsyncIterator[bytes], ctx: Call) -> None:
        p.started.set()
        try:
            async for message in requests:
                await ctx.write(message)
        except asyncio.CancelledError:
            p.seen["cancelled_flag"] = ctx.cancelled()
            p.cancelled.set()
            raise
        p.ended.set()

    async def echo_read(_requests: Any, ctx: Call) -> None:
        while (message := await ctx.read()) is not grpc.aio.EOF:
            await ctx.write(message)

    async def unary(request: bytes, ctx: Call) -> bytes:
        return b"re:" + request

    async def info(request: bytes, ctx: Call) -> bytes:
        return json.dumps(
            {
                "metadata": [
                    [k, v.hex() if isinstance(v, bytes) else v] for k, v in ctx.invocation_metadata()
                ],
                "peer": ctx.peer(),
                "time_remaining": ctx.time_remaining(),
            }
        ).encode()

    async def big(requests: AsyncIterator[bytes], ctx: Call) -> None:
        """Each request is a size; the reply is that many bytes of ``pattern``."""
        try:
            async for request in requests:
                await ctx.write(pattern(int(request)))
        except asyncio.CancelledError:
            p.cancelled.set()
            raise

    async def total(requests: AsyncIterator[bytes], ctx: Call) -> bytes:
        return b"%d" % sum([len(m) async for m in requests])

    async def count(request: bytes, ctx: Call) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield b"%d" % i

    async def hold(request: bytes, ctx: Call) -> bytes:
        p.seen["time_remaining"] = ctx.time_remaining()
        p.started.set()
        try:
            await p.release.wait()
        except asyncio.CancelledError:
            p.cancelled.set()
            raise
        return b"done"

    async def abort(request: bytes, ctx: Call) -> bytes:
        await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, DETAILS)

    async def stream_abort(requests: AsyncIterator[bytes], ctx: Call) -> None:
        async for message in requests:
            await ctx.write(message)
            await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, DETAILS)

    async def fail(request: bytes, ctx: Call) -> bytes:
        raise RuntimeError("boom")

    async def set_status(request: bytes, ctx: Call) -> bytes:
        ctx.set_code(grpc.StatusCode.NOT_FOUND)
        ctx.set_details("no such thing")
        return b""

    return {
        "Echo": grpc.stream_stream_rpc_method_handler(echo),
        "EchoRead": grpc.stream_stream_rpc_method_handler(echo_read),
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Info": grpc.unary_unary_rpc_method_handler(info),
        "Big": grpc.stream_stream_rpc_method_handler(big),
        "Total": grpc.stream_unary_rpc_method_handler(total),
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "Hold": grpc.unary_unary_rpc_method_handler(hold),
        "Abort": grpc.unary_unary_rpc_method_handler(abort),
        "StreamAbort": grpc.stream_stream_rpc_method_handler(stream_abort),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "SetStatus": grpc.unary_unary_rpc_method_handler(set_status),
    }


@dataclass
class Env:
    probe: Probe
    server: Server
    port: int
    channel: grpc.aio.Channel

    def unary(self, name: str) -> grpc.aio.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(f"/test.T/{name}")

    def stream(self, name: str) -> grpc.aio.StreamStreamMultiCallable:
        return self.channel.stream_stream(f"/test.T/{name}")


async def start_server(
    stack: AsyncExitStack,
    probe: Probe,
    address: str = "127.0.0.1:0",
    context: ssl.SSLContext | None = None,
    **options: Any,
) -> tuple[Server, int]:
    server = Server(**options)
    server.add_registered_method_handlers("test.T", service(probe))
    # the generic path too (grpc.aio.Server's other registration call)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.G", service(probe)),))
    port = server.add_insecure_port(address) if context is None else server.add_secure_port(address, context)
    await server.start()
    stack.push_async_callback(server.stop, 0)
    return server, port


def open_channel(
    stack: AsyncExitStack,
    target: str,
    credentials: grpc.ChannelCredentials | None = None,
    options: Iterable[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    opts = [*CHANNEL_OPTIONS, *options]
    if credentials is None:
        channel = grpc.aio.insecure_channel(target, options=opts)
    else:
        channel = grpc.aio.secure_channel(target, credentials, options=opts)
    stack.push_async_callback(channel.close)
    return channel


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


@pytest.fixture
async def env(stack: AsyncExitStack) -> Env:
    probe = Probe()
    server, port = await start_server(stack, probe, max_receive_message_length=BIG)
    return Env(probe, server, port, open_channel(stack, f"127.0.0.1:{port}"))


async def rpc_error(awaitable: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(awaitable, T)
    return e.value


async def echo_call(env: Env, messages: list[bytes], method: str = "/test.T/Echo") -> list[bytes]:
    """One stream-stream call: every message written, then the replies; the status must be OK."""
    call = env.channel.stream_stream(method)()
    for m in messages:
        await call.write(m)
    await call.done_writing()
    replies = [r async for r in call]
    assert await call.code() == OK
    return replies


# ----------------------------------------------------------------------------- grpc.aio client


@pytest.mark.parametrize("method", ["/test.T/Echo", "/test.T/EchoRead", "/test.G/Echo"])
async def test_stream_stream_echo_small_messages(env: Env, method: str) -> None:
    messages = [b"", b"a", b"hello", pattern(1000), pattern(70_000, 1)]
    assert await asyncio.wait_for(echo_call(env, messages, method), T) == messages


async def test_stream_stream_echo_3mb_each_way(env: Env) -> None:
    async def one(seed: int) -> None:
        messages = [pattern(3 << 20, seed), pattern(3 << 20, seed + 100)]
        assert await echo_call(env, messages) == messages

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 6 * T)


async def test_a_piece_decoder_gets_a_long_message_in_pieces(env: Env) -> None:
    seen: list[int] = []

    def decode(pieces: list[memoryview]) -> bytes:
        seen.append(len(pieces))
        return b"".join(pieces)

    env.server.add_piece_decoder("/test.T/EchoRead", decode)
    messages = [pattern(3 << 20, 7), b"short"]
    assert await asyncio.wait_for(echo_call(env, messages, "/test.T/EchoRead"), T) == messages
    assert len(seen) == 1 and seen[0] > 1  # the long message arrived over several frames or reads;
    # the short one went to the deserializer whole


async def test_200_concurrent_calls_on_one_channel(env: Env) -> None:
    n = 200
    all_open = asyncio.Barrier(n + 1)

    async def one(i: int) -> None:
        messages = [b"%d-%d:" % (i, k) + pattern(50 * k, i) for k in range(3)]
        call = env.stream("Echo")()
        await call.write(messages[0])
        assert await call.read() == messages[0]
        await all_open.wait()  # every call is open at once
        for m in messages[1:]:
            await call.write(m)
        await call.done_writing()
        assert [await call.read() for _ in messages[1:]] == messages[1:]
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == OK

    calls = asyncio.gather(*(one(i) for i in range(n)))
    await asyncio.wait_for(all_open.wait(), 3 * T)
    assert [len(conn.calls) for conn in env.server.connections] == [n]  # one connection, n streams
    await asyncio.wait_for(calls, 3 * T)


async def test_unary_unary_stream_unary_and_unary_stream(env: Env) -> None:
    assert await asyncio.wait_for(env.unary("Unary")(b"ping"), T) == b"re:ping"
    call = env.unary("Unary")(b"")
    assert await asyncio.wait_for(call, T) == b"re:"
    assert await call.code() == OK
    total = env.channel.stream_unary("/test.T/Total")
    assert await asyncio.wait_for(total(iter([b"ab", b"cde", b""])), T) == b"5"
    count = env.channel.unary_stream("/test.T/Count")(b"4")
    assert [m async for m in count] == [b"0", b"1", b"2", b"3"]
    assert await count.code() == OK


async def test_context_metadata_peer_and_time_remaining(env: Env) -> None:
    info = env.unary("Info")
    metadata = (("x-trace", "abc"), ("x-blob-bin", b"\x00\x01\xff"))
    seen = json.loads(await asyncio.wait_for(info(b"", metadata=metadata), T))
    assert ["x-trace", "abc"] in seen["metadata"]
    assert ["x-blob-bin", "0001ff"] in seen["metadata"]  # -bin values decoded from base64, as grpc
    names = [name for name, _ in seen["metadata"]]
    assert not [n for n in names if n[0] == ":" or n in ("content-type", "te") or n.startswith("grpc-")]
    assert seen["peer"].startswith("ipv4:127.0.0.1:")
    assert seen["time_remaining"] is None
    seen = json.loads(await asyncio.wait_for(info(b"", timeout=T), T))
    assert 0 < seen["time_remaining"] <= 1.1 * T  # grpc's client rounds the timeout it sends up a little


async def test_unknown_method_is_unimplemented(env: Env) -> None:
    e = await rpc_error(env.unary("Nope")(b"x"))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED
    e = await rpc_error(env.channel.unary_unary("/other.S/Unary")(b"x"))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED
    assert await asyncio.wait_for(env.unary("Unary")(b"x"), T) == b"re:x"


async def test_abort_sends_its_code_and_exact_details(env: Env) -> None:
    e = await rpc_error(env.unary("Abort")(b""))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert e.details() == DETAILS
    # in a stream the client has not half-closed, after a reply
    call = env.stream("StreamAbort")()
    await call.write(b"first")
    assert await asyncio.wait_for(call.read(), T) == b"first"
    assert await asyncio.wait_for(call.code(), T) == grpc.StatusCode.PERMISSION_DENIED
    assert await call.details() == DETAILS


async def test_set_code_and_details_without_abort(env: Env) -> None:
    e = await rpc_error(env.unary("SetStatus")(b""))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert e.details() == "no such thing"


async def test_handler_exception_is_unknown(env: Env) -> None:
    e = await rpc_error(env.unary("Fail")(b""))
    assert e.code() == grpc.StatusCode.UNKNOWN
    assert await asyncio.wait_for(env.unary("Unary")(b"x"), T) == b"re:x"


async def test_client_cancel_cancels_the_handler_and_others_go_on(env: Env) -> None:
    call = env.stream("Echo")()
    await call.write(b"one")
    assert await asyncio.wait_for(call.read(), T) == b"one"
    other = env.stream("Echo")()  # open alongside: it must survive the cancellation
    await other.write(b"two")
    assert await asyncio.wait_for(other.read(), T) == b"two"
    call.cancel()
    await asyncio.wait_for(env.probe.cancelled.wait(), T)
    assert env.probe.seen["cancelled_flag"] is True
    await other.write(b"three")
    assert await asyncio.wait_for(other.read(), T) == b"three"
    await other.done_writing()
    assert await asyncio.wait_for(other.code(), T) == OK
    assert await asyncio.wait_for(echo_call(env, [b"after"]), T) == [b"after"]


async def test_deadline_exceeded_cancels_the_handler(env: Env) -> None:
    e = await rpc_error(env.unary("Hold")(b"", timeout=0.2))
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(env.probe.cancelled.wait(), T)
    remaining = env.probe.seen["time_remaining"]
    assert remaining is not None and 0 < remaining <= 0.3  # the client sends "201m"


@pytest.mark.parametrize("limit", [1024, 100_000])
async def test_message_over_max_receive_is_resource_exhausted(stack: AsyncExitStack, limit: int) -> None:
    probe = Probe()
    server, port = await start_server(stack, probe, max_receive_message_length=limit)
    env = Env(probe, server, port, open_channel(stack, f"127.0.0.1:{port}"))
    assert await asyncio.wait_for(env.unary("Unary")(pattern(limit)), T) == b"re:" + pattern(limit)
    e = await rpc_error(env.unary("Unary")(pattern(limit + 1)))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # inside a stream, after a message that was fine
    call = env.stream("Echo")()
    await call.write(b"fine")
    assert await asyncio.wait_for(call.read(), T) == b"fine"
    await call.write(pattern(limit * 3))
    assert await asyncio.wait_for(call.code(), T) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the server, and the same connection, go on
    assert await asyncio.wait_for(echo_call(env, [b"next"]), T) == [b"next"]


async def test_health_service(stack: AsyncExitStack) -> None:
    servicer = HealthServicer()
    server = Server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stack.push_async_callback(server.stop, 0)
    stub = health_pb2_grpc.HealthStub(open_channel(stack, f"127.0.0.1:{port}"))
    await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)

    reply = await asyncio.wait_for(stub.Check(health_pb2.HealthCheckRequest(service="svc")), T)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    e = await rpc_error(stub.Check(health_pb2.HealthCheckRequest(service="unknown")))
    assert e.code() == grpc.StatusCode.NOT_FOUND

    watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"))
    first = await asyncio.wait_for(watch.read(), T)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    await servicer.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
    second = await asyncio.wait_for(watch.read(), T)
    assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()


async def test_graceful_stop_lets_an_open_call_finish(env: Env) -> None:
    call = env.unary("Hold")(b"")
    await asyncio.wait_for(env.probe.started.wait(), T)
    stopping = asyncio.create_task(env.server.stop(grace=2 * T))
    await asyncio.sleep(0)  # stop() has sent GOAWAY and closed the listener
    assert not stopping.done()
    e = await rpc_error(env.unary("Unary")(b"late", timeout=T))  # no new call once stopping
    assert e.code() == grpc.StatusCode.UNAVAILABLE
    env.probe.release.set()
    assert await asyncio.wait_for(call, T) == b"done"
    assert await call.code() == OK
    await asyncio.wait_for(stopping, T)
    assert not env.probe.cancelled.is_set()


async def test_stop_after_grace_cancels_a_handler_that_never_ends(env: Env) -> None:
    call = env.unary("Hold")(b"")
    await asyncio.wait_for(env.probe.started.wait(), T)
    await asyncio.wait_for(env.server.stop(grace=0.1), T)
    assert env.probe.cancelled.is_set()
    e = await rpc_error(call)
    assert e.code() != OK and e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


async def test_unix_socket(stack: AsyncExitStack, tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    probe = Probe()
    server, _ = await start_server(stack, probe, f"unix:{path}")
    env = Env(probe, server, 0, open_channel(stack, f"unix:{path}"))
    assert await asyncio.wait_for(echo_call(env, [b"over", b"unix"]), T) == [b"over", b"unix"]
    info = json.loads(await asyncio.wait_for(env.unary("Info")(b""), T))
    assert info["peer"].startswith("unix:")
    await server.stop(0)
    assert not path.exists()


# ------------------------------------------------------------------------------------------ TLS


def write_pair(directory: Path, pair: KeyPair) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in (("tls.crt", pair.cert), ("tls.key", pair.key), ("ca.crt", pair.ca or b"")):
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(directory / name)  # a new inode, as a renewed Secret has
    return directory


def tls_channel(
    stack: AsyncExitStack, port: int, ca: bytes, client: KeyPair | None = None
) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
    return open_channel(stack, f"127.0.0.1:{port}", credentials, [("grpc.ssl_target_name_override", "epp")])


async def test_tls(stack: AsyncExitStack, tmp_path: Path) -> None:
    ca = Authority.create()
    certs = write_pair(tmp_path / "epp", ca.issue("epp", dns_names=["epp"]))
    _, port = await start_server(stack, Probe(), context=server_ssl_context(str(certs)))
    channel = tls_channel(stack, port, ca.cert)
    assert await asyncio.wait_for(channel.unary_unary("/test.T/Unary")(b"tls"), T) == b"re:tls"
    # a client that does not trust the CA gets nowhere
    stranger = tls_channel(stack, port, Authority.create().cert)
    e = await rpc_error(stranger.unary_unary("/test.T/Unary")(b"x", timeout=T))
    assert e.code() == grpc.StatusCode.UNAVAILABLE


async def test_tls_client_certificate_required_with_a_client_ca(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    ca = Authority.create()
    certs = write_pair(tmp_path / "epp", ca.issue("epp", dns_names=["epp"]))
    context = server_ssl_context(str(certs), client_ca_file=str(certs / "ca.crt"))
    _, port = await start_server(stack, Probe(), context=context)

    anonymous = tls_channel(stack, port, ca.cert)
    e = await rpc_error(anonymous.unary_unary("/test.T/Unary")(b"x", timeout=T))
    assert e.code() == grpc.StatusCode.UNAVAILABLE
    outsider = tls_channel(stack, port, ca.cert, Authority.create().issue("envoy", server=False, client=True))
    e = await rpc_error(outsider.unary_unary("/test.T/Unary")(b"x", timeout=T))
    assert e.code() == grpc.StatusCode.UNAVAILABLE

    client = ca.issue("envoy", server=False, client=True)
    channel = tls_channel(stack, port, ca.cert, client)
    assert await asyncio.wait_for(channel.unary_unary("/test.T/Unary")(b"mtls"), T) == b"re:mtls"


async def test_tls_reload_serves_a_renewed_certificate(stack: AsyncExitStack, tmp_path: Path) -> None:
    old, new = Authority.create(), Authority.create()
    certs = write_pair(tmp_path / "epp", old.issue("epp", dns_names=["epp"]))
    context = server_ssl_context(str(certs), reload=True)
    _, port = await start_server(stack, Probe(), context=context)
    write_pair(certs, new.issue("epp", dns_names=["epp"]))  # renewed before the first handshake
    channel = tls_channel(stack, port, new.cert)
    assert await asyncio.wait_for(channel.unary_unary("/test.T/Unary")(b"new"), T) == b"re:new"


# ------------------------------------------------------------------- HTTP/2 level: the h2 client


def grpc_frame(message: bytes) -> bytes:
    return struct.pack(">BL", 0, len(message)) + message


def grpc_messages(body: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(body):
        flag, length = struct.unpack_from(">BL", body, pos)
        assert flag == 0
        out.append(body[pos + 5 : pos + 5 + length])
        pos += 5 + length
    assert pos == len(body)
    return out


class H2Client:
    """A client on python-hyper's h2: requests grpc's client would never send, and every frame
    of the response seen."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.headers: dict[int, dict[bytes, bytes]] = defaultdict(dict)  # response headers + trailers
        self.body: dict[int, bytearray] = defaultdict(bytearray)
        self.data_frames: list[int] = []  # every DATA frame's length (with padding)
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.pongs: list[bytes] = []
        self.auto_ack = True  # give flow-control credit back as DATA arrives

    @classmethod
    async def open(cls, port: int, settings: dict[h2.settings.SettingCodes, int] | None = None) -> H2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        client.auto_ack = not settings or h2.settings.SettingCodes.INITIAL_WINDOW_SIZE not in settings
        if settings:  # in the preface's SETTINGS, as a real client advertises them
            values = {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100, **settings}
            client.conn.local_settings = h2.settings.Settings(client=True, initial_values=values)
            client.conn.max_inbound_frame_size = client.conn.local_settings.max_frame_size
        client.conn.initiate_connection()
        client.flush()
        return client

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)

    async def trickle(self, step: int) -> None:
        """What is queued to send, ``step`` bytes per write with a loop turn between (the server
        gets frames cut at every place)."""
        data = self.conn.data_to_send()
        for i in range(0, len(data), step):
            self.writer.write(data[i : i + step])
            await self.writer.drain()
            await asyncio.sleep(0)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass

    async def pump(self, done: Callable[[], bool]) -> None:
        """Read and handle frames until ``done()``."""

        async def run() -> None:
            while not done():
                data = await self.reader.read(1 << 16)
                if not data:
                    raise EOFError("the server closed the connection")
                for event in self.conn.receive_data(data):
                    self._event(event)
                self.flush()

        await asyncio.wait_for(run(), T)

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            assert event.stream_id is not None and event.headers is not None
            self.headers[event.stream_id].update((bytes(k), bytes(v)) for k, v in event.headers)
        elif isinstance(event, h2.events.DataReceived):
            assert event.stream_id is not None and event.data is not None
            self.body[event.stream_id] += event.data
            self.data_frames.append(event.flow_controlled_length or 0)
            if self.auto_ack and event.flow_controlled_length:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            assert event.stream_id is not None
            self.ended.add(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            assert event.stream_id is not None
            self.resets[event.stream_id] = int(event.error_code or 0)
        elif isinstance(event, h2.events.PingAckReceived):
            assert event.ping_data is not None
            self.pongs.append(event.ping_data)

    def request(
        self,
        path: str,
        messages: Iterable[bytes] = (),
        *,
        content_type: bytes = b"application/grpc",
        extra: Iterable[tuple[bytes, bytes]] = (),
        end: bool = True,
        chunk: int = 16_384,
        pad: int | None = None,
        priority: bool = False,
        flush: bool = True,
        body: bytes | None = None,
    ) -> int:
        sid = self.conn.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", b"test"),
            (b"content-type", content_type),
            (b"te", b"trailers"),
            *extra,
        ]
        if body is None:
            body = b"".join(grpc_frame(m) for m in messages)
        prio: dict[str, Any] = {"priority_weight": 32, "priority_depends_on": 0} if priority else {}
        self.conn.send_headers(sid, headers, end_stream=end and not body, **prio)
        for i in range(0, len(body), chunk):
            self.conn.send_data(sid, body[i : i + chunk], pad_length=pad)
        if end and body:
            self.conn.end_stream(sid)
        if flush:
            self.flush()
        return sid

    async def response(self, sid: int) -> tuple[dict[bytes, bytes], list[bytes]]:
        await self.pump(lambda: sid in self.ended)
        return self.headers[sid], grpc_messages(bytes(self.body[sid]))

    async def ping(self, payload: bytes = b"barrier!") -> None:
        """A PING round trip: whatever the server sent before its ACK has been handled."""
        n = len(self.pongs)
        self.conn.ping(payload)
        self.flush()
        await self.pump(lambda: len(self.pongs) > n)
        assert self.pongs[-1] == payload


@pytest.fixture
async def h2c(env: Env) -> AsyncIterator[Callable[..., Any]]:
    clients: list[H2Client] = []

    async def connect(settings: dict[h2.settings.SettingCodes, int] | None = None) -> H2Client:
        client = await H2Client.open(env.port, settings)
        clients.append(client)
        return client

    yield connect
    for c in clients:
        await c.close()


async def test_content_type_not_grpc_is_an_error_status(env: Env, h2c: Callable[..., Any]) -> None:
    client: H2Client = await h2c()
    sid = client.request("/test.T/Unary", [b"x"], content_type=b"application/json")
    headers, messages = await client.response(sid)
    assert headers[b"grpc-status"] != b"0"
    assert messages == []
    # the connection is still good for a real call
    sid = client.request("/test.T/Unary", [b"x"])
    headers, messages = await client.response(sid)
    assert headers[b"grpc-status"] == b"0" and messages == [b"re:x"]


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/test.T/Unary", b"", grpc.StatusCode.INTERNAL),  # no request message
        ("/test.T/Unary", grpc_frame(b"hello")[:-2], grpc.StatusCode.INTERNAL),  # ends inside one
        ("/test.T/Echo", b"\x01" + grpc_frame(b"zipped")[1:], grpc.StatusCode.UNIMPLEMENTED),  # compressed
        ("/test.T/Echo", grpc_frame(b"ok") + b"\x00\x00", grpc.StatusCode.INTERNAL),  # ends inside a prefix
    ],
)
async def test_malformed_request_bodies_end_with_a_status(
    env: Env, h2c: Callable[..., Any], path: str, body: bytes, code: grpc.StatusCode
) -> None:
    client: H2Client = await h2c()
    headers, _ = await client.response(client.request(path, body=body))
    assert headers[b"grpc-status"] == b"%d" % code.value[0]
    headers, messages = await client.response(client.request("/test.T/Unary", [b"next"]))
    assert headers[b"grpc-status"] == b"0" and messages == [b"re:next"]


async def test_grpc_message_is_percent_encoded_on_the_wire(env: Env, h2c: Callable[..., Any]) -> None:
    client: H2Client = await h2c()
    headers, _ = await client.response(client.request("/test.T/Abort", [b""]))
    assert headers[b"grpc-status"] == b"%d" % grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert headers[b"grpc-message"] == b"n%C3%A4h: 100%25 sure"


async def test_grpc_timeout_header_is_enforced_by_the_server(env: Env, h2c: Callable[..., Any]) -> None:
    client: H2Client = await h2c()  # a client that never gives up itself
    sid = client.request("/test.T/Hold", [b""], extra=[(b"grpc-timeout", b"100m")])
    headers, messages = await client.response(sid)
    assert headers[b"grpc-status"] == b"%d" % grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert messages == []
    await asyncio.wait_for(env.probe.cancelled.wait(), T)
    assert 0 < env.probe.seen["time_remaining"] <= 0.1


async def test_messages_split_across_tiny_padded_data_frames(env: Env, h2c: Callable[..., Any]) -> None:
    client: H2Client = await h2c()
    messages = [b"hello", b"", pattern(3000), b"x"]
    for chunk, pad, priority in ((1, None, False), (3, 7, True), (4, 0, False), (7, 200, True)):
        sid = client.request("/test.T/Echo", messages, chunk=chunk, pad=pad, priority=priority)
        headers, echoed = await client.response(sid)
        assert headers[b"grpc-status"] == b"0"
        assert echoed == messages


@pytest.mark.parametrize(
    ("chunk", "pad", "step"), [(300_000, None, 997), (70_000, 255, 4093), (1 << 20, None, 65_536)]
)
async def test_long_data_frames_arriving_in_pieces(
    env: Env, h2c: Callable[..., Any], chunk: int, pad: int | None, step: int
) -> None:
    client: H2Client = await h2c()
    await client.ping()  # the server's SETTINGS are in: frames of up to 1 MiB may be sent
    messages = [pattern(150_000), b"a", b"", pattern(40_000, 1), pattern(600_000, 2)]
    chunk = min(chunk, client.conn.max_outbound_frame_size - 256)
    sid = client.request("/test.T/Echo", messages, chunk=chunk, pad=pad, flush=False)
    await asyncio.wait_for(client.trickle(step), T)
    headers, echoed = await client.response(sid)
    assert headers[b"grpc-status"] == b"0"
    assert echoed == messages


async def test_flow_control_small_client_window(env: Env, h2c: Callable[..., Any]) -> None:
    size = 200_000
    client: H2Client = await h2c({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1024})
    sid = client.request("/test.T/Big", [b"%d" % size], end=False)
    await client.pump(lambda: len(client.body[sid]) >= 1024)
    await client.ping()
    assert len(client.body[sid]) == 1024  # h2 itself fails the test if the window is overrun
    # the stream's window opens; the connection's (65,535 at first) still limits
    client.conn.increment_flow_control_window(4 * size, stream_id=sid)
    client.flush()
    await client.pump(lambda: len(client.body[sid]) >= 65_535)
    await client.ping()
    assert len(client.body[sid]) == 65_535
    client.conn.increment_flow_control_window(4 * size)
    client.flush()
    client.conn.end_stream(sid)
    client.flush()
    headers, messages = await client.response(sid)
    assert headers[b"grpc-status"] == b"0"
    assert messages == [pattern(size)]
    assert max(client.data_frames) <= 16_384


@pytest.mark.parametrize("max_frame", [16_384, 20_000])
async def test_data_frames_never_exceed_the_client_max_frame_size(
    env: Env, h2c: Callable[..., Any], max_frame: int
) -> None:
    codes = h2.settings.SettingCodes
    client: H2Client = await h2c({codes.INITIAL_WINDOW_SIZE: 1 << 24, codes.MAX_FRAME_SIZE: max_frame})
    client.conn.increment_flow_control_window(1 << 24)
    sizes = [200_000, 40_000, 100, max_frame - 5, max_frame - 4, 65_535, 65_536]
    sid = client.request("/test.T/Big", [b"%d" % n for n in sizes])
    headers, messages = await client.response(sid)
    assert headers[b"grpc-status"] == b"0"
    assert messages == [pattern(n) for n in sizes]
    assert max(client.data_frames) <= max_frame


async def test_reset_while_blocked_on_flow_control_cancels_the_handler(
    env: Env, h2c: Callable[..., Any]
) -> None:
    client: H2Client = await h2c({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1024})
    sid = client.request("/test.T/Big", [b"200000"], end=False)
    await client.pump(lambda: len(client.body[sid]) >= 1024)
    client.conn.reset_stream(sid)
    client.flush()
    await asyncio.wait_for(env.probe.cancelled.wait(), T)
    # the connection goes on (what is left of its window is enough for this reply)
    headers, messages = await client.response(client.request("/test.T/Unary", [b"again"]))
    assert headers[b"grpc-status"] == b"0" and messages == [b"re:again"]


# --------------------------------------------------------------------- HTTP/2 level: raw frames

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x6

Frame = tuple[int, int, int, bytes]  # type, flags, stream, payload


def raw_frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">L", len(payload))[1:] + struct.pack(">BBL", kind, flags, sid) + payload


class Raw:
    """Bytes on a socket and the frames that come back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, first: bytes = PREFACE + raw_frame(SETTINGS, 0, 0)) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(first)
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frame(self) -> Frame | None:
        """The next frame; None when the server closed the connection."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), T)
            length = int.from_bytes(head[:3], "big")
            kind, flags, sid = struct.unpack(">BBL", head[3:])
            payload = await asyncio.wait_for(self.reader.readexactly(length), T)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
        return kind, flags, sid & 0x7FFFFFFF, payload

    async def until(self, match: Callable[[Frame], bool]) -> Frame:
        while True:
            got = await self.frame()
            assert got is not None, "the connection closed first"
            if match(got):
                return got

    async def rest(self) -> list[Frame]:
        """Every frame until the server closes the connection."""
        out = []
        while (got := await self.frame()) is not None:
            out.append(got)
        return out

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


def goaway_codes(frames: list[Frame]) -> list[int]:
    return [struct.unpack(">LL", p[:8])[1] for kind, _, _, p in frames if kind == GOAWAY]


@pytest.fixture
async def raw(env: Env) -> AsyncIterator[Callable[..., Any]]:
    opened: list[Raw] = []

    async def connect(first: bytes = PREFACE + raw_frame(SETTINGS, 0, 0)) -> Raw:
        conn = await Raw.open(env.port, first)
        opened.append(conn)
        return conn

    yield connect
    for c in opened:
        await c.close()


async def test_bad_preface_closes_the_connection_and_others_are_served(
    env: Env, raw: Callable[..., Any]
) -> None:
    conn: Raw = await raw(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
    frames = await conn.rest()  # returns only once the server closed the connection
    assert all(code == PROTOCOL_ERROR for code in goaway_codes(frames))
    assert await asyncio.wait_for(env.unary("Unary")(b"still"), T) == b"re:still"


def window_update(sid: int, increment: int) -> bytes:
    return raw_frame(WINDOW_UPDATE, 0, sid, struct.pack(">L", increment))


CONNECTION_ERRORS = {
    "data-on-idle-stream": (raw_frame(DATA, 0, 1, grpc_frame(b"x")), PROTOCOL_ERROR),
    "data-on-stream-0": (raw_frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    "headers-on-even-stream": (raw_frame(HEADERS, END_HEADERS, 2, b""), PROTOCOL_ERROR),
    "lone-continuation": (raw_frame(CONTINUATION, END_HEADERS, 1, b""), PROTOCOL_ERROR),
    "short-ping": (raw_frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
    "ping-on-a-stream": (raw_frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
    "settings-ack-with-payload": (raw_frame(SETTINGS, ACK, 0, b"\x00\x04\x00\x00\x00\x01"), FRAME_SIZE_ERROR),
    "odd-settings": (raw_frame(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
    "frame-too-large": (b"\x7f\xff\xff" + struct.pack(">BBL", DATA, 0, 1), FRAME_SIZE_ERROR),
    "window-update-0": (window_update(0, 0), PROTOCOL_ERROR),
    "connection-window-overflow": (window_update(0, (1 << 31) - 1), FLOW_CONTROL_ERROR),
}


@pytest.mark.parametrize(("frames", "code"), CONNECTION_ERRORS.values(), ids=CONNECTION_ERRORS.keys())
async def test_connection_errors_send_goaway_and_close(
    env: Env, raw: Callable[..., Any], frames: bytes, code: int
) -> None:
    conn: Raw = await raw()
    conn.send(frames)
    got = await conn.rest()
    assert goaway_codes(got) == [code]
    assert await asyncio.wait_for(env.unary("Unary")(b"still"), T) == b"re:still"


async def test_ping_is_acked_with_its_payload(raw: Callable[..., Any]) -> None:
    conn: Raw = await raw()
    conn.send(raw_frame(PING, 0, 0, b"\x00\x01pingme"))
    _, flags, sid, payload = await conn.until(lambda fr: fr[0] == PING)
    assert (flags & ACK, sid, payload) == (ACK, 0, b"\x00\x01pingme")
    conn.send(raw_frame(PING, ACK, 0, b"ackonly!"))  # an ACK is not answered
    conn.send(raw_frame(PING, 0, 0, b"second.."))
    *_, payload = await conn.until(lambda fr: fr[0] == PING)
    assert payload == b"second.."


async def test_settings_are_acked(raw: Callable[..., Any]) -> None:
    conn: Raw = await raw()
    server_settings = await conn.until(lambda fr: fr[0] == SETTINGS and not fr[1] & ACK)
    assert server_settings[2] == 0
    await conn.until(lambda fr: fr[0] == SETTINGS and bool(fr[1] & ACK))  # for the preface's
    conn.send(raw_frame(SETTINGS, 0, 0, struct.pack(">HL", 0x4, 1 << 20) + struct.pack(">HL", 0x5, 32_768)))
    _, flags, sid, payload = await conn.until(lambda fr: fr[0] == SETTINGS)
    assert (flags, sid, payload) == (ACK, 0, b"")


def request_block(path: str, *extra: tuple[str, str]) -> bytes:
    return Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "test"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
    )


async def read_response(conn: Raw, sid: int) -> tuple[dict[str, str], bytes]:
    """Header fields (headers and trailers) and DATA of stream ``sid`` up to its END_STREAM."""
    decoder, body = Decoder(), b""
    fields: dict[str, str] = {}
    while True:
        kind, flags, got, payload = await conn.until(lambda fr: fr[0] in (HEADERS, DATA))
        assert got == sid
        if kind == DATA:
            body += payload
        else:
            fields.update((str(k), str(v)) for k, v in decoder.decode(payload))
        if flags & END_STREAM:
            return fields, body


@pytest.mark.parametrize(
    ("increment", "code"),
    [(0, PROTOCOL_ERROR), ((1 << 31) - 1, FLOW_CONTROL_ERROR)],
    ids=["zero", "overflow"],
)
async def test_bad_stream_window_update_resets_only_that_stream(
    env: Env, raw: Callable[..., Any], increment: int, code: int
) -> None:
    conn: Raw = await raw()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Echo")))
    conn.send(raw_frame(DATA, 0, 1, grpc_frame(b"hi")))
    await conn.until(lambda fr: fr[0] == DATA and fr[2] == 1)  # the handler runs
    conn.send(window_update(1, increment))
    kind, _, sid, payload = await conn.until(lambda fr: fr[0] in (RST_STREAM, GOAWAY))
    assert (kind, sid, payload) == (RST_STREAM, 1, struct.pack(">L", code))
    await asyncio.wait_for(env.probe.cancelled.wait(), T)
    conn.send(raw_frame(HEADERS, END_HEADERS, 3, request_block("/test.T/Unary")))
    conn.send(raw_frame(DATA, END_STREAM, 3, grpc_frame(b"on")))
    fields, body = await read_response(conn, 3)
    assert fields["grpc-status"] == "0" and grpc_messages(body) == [b"re:on"]


async def test_end_stream_then_reset_ends_a_reading_handler_with_eof(
    env: Env, raw: Callable[..., Any]
) -> None:
    """Envoy half-closes an ext_proc stream and resets it in one go: a handler waiting for the next
    message reads the end of the requests (as it would have a moment earlier), not a cancellation."""
    conn: Raw = await raw()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Echo")))
    conn.send(raw_frame(DATA, 0, 1, grpc_frame(b"one")))
    await conn.until(lambda fr: fr[0] == DATA and fr[2] == 1)  # echoed: the handler waits in read
    conn.send(raw_frame(DATA, END_STREAM, 1, b"") + raw_frame(RST_STREAM, 0, 1, struct.pack(">L", 8)))
    await asyncio.wait_for(env.probe.ended.wait(), T)
    assert not env.probe.cancelled.is_set()
    # a reset while the client's side is still open cancels the handler
    conn.send(raw_frame(HEADERS, END_HEADERS, 3, request_block("/test.T/Echo")))
    conn.send(raw_frame(DATA, 0, 3, grpc_frame(b"two")))
    await conn.until(lambda fr: fr[0] == DATA and fr[2] == 3)
    conn.send(raw_frame(RST_STREAM, 0, 3, struct.pack(">L", 8)))
    await asyncio.wait_for(env.probe.cancelled.wait(), T)


async def test_stream_window_is_credited_in_large_steps_not_per_message(raw: Callable[..., Any]) -> None:
    conn: Raw = await raw()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Echo")))
    for i in range(40):  # small messages: no WINDOW_UPDATE for the stream
        conn.send(raw_frame(DATA, 0, 1, grpc_frame(b"m%d" % i)))
    frames = [await conn.until(lambda fr: fr[0] in (DATA, WINDOW_UPDATE) and fr[2] == 1) for _ in range(40)]
    assert [kind for kind, _, _, _ in frames] == [DATA] * 40
    big = pattern(CREDIT_FROM)  # one message past a quarter of the stream window: credited back
    payload = grpc_frame(big)
    for at in range(0, len(payload), 16_384):  # the default largest frame
        conn.send(raw_frame(DATA, 0, 1, payload[at : at + 16_384]))
    update = await conn.until(lambda fr: fr[0] == WINDOW_UPDATE and fr[2] == 1)
    assert struct.unpack(">L", update[3])[0] >= CREDIT_FROM


async def test_client_goaway_lets_open_calls_finish_then_closes(raw: Callable[..., Any]) -> None:
    conn: Raw = await raw()
    conn.send(raw_frame(HEADERS, END_HEADERS, 1, request_block("/test.T/Echo")))
    conn.send(raw_frame(DATA, 0, 1, grpc_frame(b"before")))
    await conn.until(lambda fr: fr[0] == DATA and fr[2] == 1)
    conn.send(raw_frame(GOAWAY, 0, 0, struct.pack(">LL", 0, NO_ERROR)))
    conn.send(raw_frame(DATA, 0, 1, grpc_frame(b"after")))
    conn.send(raw_frame(HEADERS, END_HEADERS | END_STREAM, 3, request_block("/test.T/Unary")))  # refused
    conn.send(raw_frame(DATA, END_STREAM, 1, b""))
    fields, body = await read_response(conn, 1)
    assert fields["grpc-status"] == "0" and grpc_messages(body) == [b"after"]
    rest = await conn.rest()  # ends: the server closed the connection
    assert [(kind, sid) for kind, _, sid, _ in rest if kind in (HEADERS, DATA)] == []


async def test_header_blocks_follow_the_hpack_dynamic_table(raw: Callable[..., Any]) -> None:
    """A block sent again byte for byte after the dynamic table changed means other headers: the
    server must decode it afresh (as a reference decoder does), not from what it meant before."""
    conn: Raw = await raw()
    encoder, reference = Encoder(), Decoder()
    base = [
        NeverIndexedHeaderTuple(name, value)  # kept out of the dynamic table
        for name, value in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/test.T/Info"),
            (":authority", "test"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    ]
    blocks = [encoder.encode([*base, ("x-k", value)]) for value in ("one", "one", "two", "two")]
    assert blocks[1] == blocks[3]  # "x-k: one", then "x-k: two", as dynamic table entry 62
    for i, block in enumerate(blocks):
        sid = 2 * i + 1
        expected = {str(k): str(v) for k, v in reference.decode(block)}["x-k"]
        conn.send(
            raw_frame(HEADERS, END_HEADERS, sid, block) + raw_frame(DATA, END_STREAM, sid, grpc_frame(b""))
        )
        fields, body = await read_response(conn, sid)
        assert fields["grpc-status"] == "0"
        metadata = dict(json.loads(grpc_messages(body)[0])["metadata"])
        assert metadata["x-k"] == expected, f"request {i}"


async def test_header_block_in_continuation_frames(raw: Callable[..., Any]) -> None:
    conn: Raw = await raw()
    block = request_block("/test.T/Info", ("x-long", "v" * 5000))
    a, b = len(block) // 3, 2 * len(block) // 3
    conn.send(
        raw_frame(HEADERS, 0, 1, block[:a])
        + raw_frame(CONTINUATION, 0, 1, block[a:b])
        + raw_frame(CONTINUATION, END_HEADERS, 1, block[b:])
        + raw_frame(DATA, END_STREAM, 1, grpc_frame(b""))
    )
    fields, body = await read_response(conn, 1)
    assert fields["grpc-status"] == "0"
    (reply,) = grpc_messages(body)
    assert ["x-long", "v" * 5000] in json.loads(reply)["metadata"]


def test_port_in_use_fails_at_bind() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="Failed to bind"):
            Server().add_insecure_port(f"127.0.0.1:{s.getsockname()[1]}")


class _Marker:
    """Held by a handler's frame: alive as long as that frame is."""


async def test_calls_ended_by_the_client_leave_no_reference_cycle(stack: AsyncExitStack) -> None:
    """A cancelled handler's frame (and what it holds, e.g. a request body) is freed at once, not
    when a full garbage collection finds a cycle through the cancellation's traceback."""
    alive: list[weakref.ref[_Marker]] = []
    entered = asyncio.Event()

    async def hold(requests: AsyncIterator[bytes], ctx: Call) -> None:
        marker = _Marker()
        alive.append(weakref.ref(marker))
        entered.set()
        await ctx.read()  # a message never comes: the client cancels
        await ctx.read()
        del marker

    server = Server()
    server.add_registered_method_handlers("test.H", {"Hold": grpc.stream_stream_rpc_method_handler(hold)})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stack.push_async_callback(server.stop, 0)
    channel = open_channel(stack, f"127.0.0.1:{port}")
    gc.disable()
    try:
        for _ in range(5):
            entered.clear()
            call = channel.stream_stream("/test.H/Hold")()
            await call.write(b"x")
            await asyncio.wait_for(entered.wait(), T)
            call.cancel()
        await asyncio.wait_for(
            _until(lambda: len(server.connections) == 1 and not next(iter(server.connections)).calls), T
        )
        for _ in range(5):
            await asyncio.sleep(0)
        assert [ref() for ref in alive] == [None] * 5
    finally:
        gc.enable()


async def _until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.01)


async def test_a_connection_without_the_client_preface_is_closed(stack: AsyncExitStack) -> None:
    _, port = await start_server(stack, Probe(), preface_timeout=0.2)
    silent = await Raw.open(port, first=b"")
    rest = await silent.rest()  # the server closes it: the frames it sent, then EOF
    assert goaway_codes(rest) == [PROTOCOL_ERROR]
    talking = await Raw.open(port)  # the preface in time: the connection stays after the timeout
    await asyncio.sleep(0.4)
    talking.send(raw_frame(PING, 0, 0, b"stillok!"))
    assert (await talking.until(lambda fr: fr[0] == PING))[3] == b"stillok!"
    await silent.close()
    await talking.close()
