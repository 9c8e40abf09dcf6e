"""Traffic of ``bench/soak.py``: well-behaved clients and hostile ones, all on 127.0.0.1.

Every outcome is counted in a :class:`Tally`; every loop checks its deadline and every request has
a timeout.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench._loadgen import sentence, system_prompt

CHAT_PATH = "/v1/chat/completions"
PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
REWRITE_HEADER = "x-gateway-model-name-rewrite"
JSON_HEADERS = {"content-type": "application/json"}
MIB = 1 << 20


@dataclass
class Tally:
    """Outcomes per kind of traffic: ``{kind: Counter({status: n})}``, plus request start times."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    timeline: list[tuple[float, str, str]] = field(default_factory=list)  # (start, kind, status)
    keep_timeline: bool = False

    def add(self, kind: str, status: str, started: float = 0.0) -> None:
        self.counts.setdefault(kind, Counter())[status] += 1
        if self.keep_timeline:
            self.timeline.append((started, kind, status))

    def total(self, kind: str) -> int:
        return sum(self.counts.get(kind, Counter()).values())


def _error_name(e: BaseException) -> str:
    return "timeout" if isinstance(e, TimeoutError | asyncio.TimeoutError) else type(e).__name__


async def paced(
    rate: float,
    deadline: float,
    make: Callable[[int], Awaitable[None]],
    *,
    limit: int,
    rng: random.Random,
    on_skip: Callable[[], None] | None = None,
) -> None:
    """Start ``make(i)`` at Poisson times (``rate`` per second) until ``deadline``; at most
    ``limit`` at once (a start that would exceed it is skipped and reported to ``on_skip``)."""
    if rate <= 0:
        return
    tasks: set[asyncio.Task[None]] = set()
    i = 0
    next_at = time.monotonic()
    while True:
        next_at += rng.expovariate(rate)
        delay = next_at - time.monotonic()
        if next_at >= deadline:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= limit:
            if on_skip is not None:
                on_skip()
            continue
        task = asyncio.create_task(make(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0) + 35)


# ------------------------------------------------------------------------------ well-behaved


class GoodClient:
    """Chat completions through Envoy; ``unique_fraction`` of them have a prompt of their own."""

    def __init__(
        self,
        session: Any,
        url: str,
        tally: Tally,
        *,
        model: str,
        seed: int,
        groups: int = 8,
        prompt_chars: int = 2000,
        unique_fraction: float = 0.7,
        timeout: float = 30.0,
    ) -> None:
        self.session = session
        self.url = url + CHAT_PATH
        self.tally = tally
        self.model = model
        self.rng = random.Random(f"good-{seed}")
        self.prompts = [system_prompt(g, prompt_chars, seed) for g in range(groups)]
        self.prompt_chars = prompt_chars
        self.unique_fraction = unique_fraction
        self.timeout = timeout
        self.unique_prompts = 0
        self.t0 = time.monotonic()

    def body(self, i: int) -> tuple[bytes, bool]:
        rng = self.rng
        stream = rng.random() < 0.5
        question = f"Question {i}: {sentence(rng)}"
        if rng.random() < self.unique_fraction:
            self.unique_prompts += 1
            words = [f"Unique prompt {i} ({rng.getrandbits(64):016x})."]
            while sum(len(w) + 1 for w in words) < self.prompt_chars:
                words.append(sentence(rng))
            system = " ".join(words)
        else:
            system = self.prompts[rng.randrange(len(self.prompts))]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 8,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body).encode(), stream

    async def one(self, i: int) -> None:
        import aiohttp

        data, stream = self.body(i)
        started = time.monotonic() - self.t0
        kind = "stream" if stream else "plain"
        try:
            async with self.session.post(
                self.url,
                data=data,
                headers=JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as resp:
                status = self.status(resp, await resp.read(), stream)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            status = _error_name(e)
        self.tally.add(kind, status, started)

    def status(self, resp: Any, payload: bytes, stream: bool) -> str:
        """How a response is counted: its HTTP status, and a stream that did not end properly."""
        if resp.status == 200 and stream and b"data: [DONE]" not in payload:
            return "200 without [DONE]"
        return str(resp.status)


# ------------------------------------------------------------------------------ hostile HTTP


class HostileHttp:
    """Hostile requests through Envoy; each kind is its own method taking a sequence number."""

    def __init__(
        self, session: Any, url: str, tally: Tally, *, model: str, max_body: int, timeout: float = 30.0
    ) -> None:
        self.session = session
        self.url = url + CHAT_PATH
        self.tally = tally
        self.model = model
        self.max_body = max_body
        self.timeout = timeout

    async def _post(self, kind: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        import aiohttp

        try:
            async with self.session.post(
                self.url,
                data=data,
                headers={**JSON_HEADERS, **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as resp:
                await resp.read()
                status = str(resp.status)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            status = _error_name(e)
        self.tally.add(kind, status)

    async def many_models(self, i: int) -> None:
        body = {"model": f"soak-model-{i:06d}", "messages": [{"role": "user", "content": f"hi {i}"}]}
        await self._post("distinct models", json.dumps(body).encode())

    async def malformed_json(self, i: int) -> None:
        variants = (
            b'{"model": "demo", "messages": [',
            b'{"model": "demo", "messages": [{"role": "user", "content": "x"}]}}}',
            b"\xff\xfe\x00not json at all",
            b'{"model": ' + b"9" * 4000 + b"}",
            b'["model", "demo"]',
            b'{"model": "demo", "messages": "\\ud800"}',
        )
        await self._post("malformed JSON", variants[i % len(variants)])

    async def deep_json(self, i: int) -> None:
        depth = (1000, 10_000, 100_000)[i % 3]
        nested = "[" * depth + "]" * depth
        text = (
            f'{{"model": "{self.model}", "messages": [{{"role": "user", "content": "deep {i}"}}], '
            f'"extra": {nested}}}'
        )
        await self._post("deep JSON + rewrite header", text.encode(), {REWRITE_HEADER: f"{self.model}-b"})

    async def oversized(self, i: int) -> None:
        filler = "x" * (self.max_body + 64 * 1024)
        text = f'{{"model": "{self.model}", "messages": [{{"role": "user", "content": "{filler}"}}]}}'
        await self._post("body over the limit", text.encode())


# ------------------------------------------------------------------------------ hostile gRPC


def _messages() -> tuple[Any, Any]:
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    return ep, (HeaderMap, HeaderValue)


def headers_request(authority: str, i: int, *, body_mode: int = 4) -> Any:
    """The first message Envoy sends for a POST (request headers with the protocol config)."""
    ep, (header_map, header_value) = _messages()
    headers = {
        ":method": "POST",
        ":path": CHAT_PATH,
        ":authority": authority,
        "content-type": "application/json",
        "x-request-id": f"soak-hostile-{i}",
    }
    req = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=header_map(
                headers=[header_value(key=k, raw_value=v.encode()) for k, v in headers.items()]
            )
        )
    )
    req.protocol_config.request_body_mode = body_mode
    req.protocol_config.response_body_mode = 0
    return req


def body_request(body: bytes, end_of_stream: bool) -> Any:
    ep, _ = _messages()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


@dataclass
class _Held:
    """A stream that the client keeps open; the server may end it (``outcome`` is then set)."""

    call: Any
    outcome: str = ""


class HostileGrpc:
    """Direct ext_proc clients (one grpc.aio channel each, as separate clients would be)."""

    def __init__(self, port: int, tally: Tally, *, model: str) -> None:
        self.target = f"127.0.0.1:{port}"
        self.port = port
        self.tally = tally
        self.model = model
        self.held: dict[str, list[_Held]] = {"stalled after headers": [], "partial body held": []}
        self._channels: list[Any] = []

    def _channel(self, keep: bool = False) -> Any:
        """A channel of its own (own TCP connection: no shared subchannel pool), as a separate client
        would have; ``keep`` ones are closed by :meth:`close`, the others by their caller."""
        import grpc

        options = [("grpc.max_send_message_length", 64 * MIB), ("grpc.use_local_subchannel_pool", 1)]
        channel = grpc.aio.insecure_channel(self.target, options=options)
        if keep:
            self._channels.append(channel)
        return channel

    @staticmethod
    def _stub(channel: Any) -> Any:
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

        return ep_grpc.ExternalProcessorStub(channel)

    async def _hold(self, kind: str, held: _Held) -> None:
        """Wait until the server ends the held stream (the client never does until :meth:`close`)."""
        import grpc

        self.held[kind].append(held)
        try:
            while True:
                reply = await held.call.read()
                if reply is grpc.aio.EOF:
                    held.outcome = f"ended by the server: {(await held.call.code()).name}"
                    break
                if reply.HasField("immediate_response"):
                    status = reply.immediate_response.status.code
                    held.outcome = f"ended by the server: immediate_response {status}"
                    break
        except grpc.aio.AioRpcError as e:
            held.outcome = f"ended by the server: {e.code().name}"
        except asyncio.CancelledError:
            held.outcome = "open until the client left"
            raise

    @staticmethod
    async def _write_all(call: Any, messages: list[Any]) -> str:
        """Write ``messages``; "" when all went, else how the server ended the stream first."""
        import grpc

        sent = 0
        try:
            for m in messages:
                await call.write(m)
                sent += 1
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            try:
                code = (await asyncio.wait_for(call.code(), 10)).name
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                code = _error_name(e)
            return f"ended by the server after {sent} of {len(messages)} messages: {code}"
        return ""

    async def stall_after_headers(self, i: int) -> None:
        call = self._stub(self._channel(keep=True)).Process()
        ended = await self._write_all(call, [headers_request(self.target, i)])
        if ended:
            self.tally.add("stalled after headers", ended)
            return
        await self._hold("stalled after headers", _Held(call))

    async def hold_partial_body(self, i: int, *, mib: int) -> None:
        call = self._stub(self._channel(keep=True)).Process()
        chunk = (b'{"model": "%s", "messages": [{"role": "user", "content": "' % self.model.encode()).ljust(
            MIB, b"p"
        )
        messages = [headers_request(self.target, i)] + [body_request(chunk, False) for _ in range(mib)]
        ended = await self._write_all(call, messages)
        if ended:
            self.tally.add("partial body held", ended)
            return
        await self._hold("partial body held", _Held(call))

    async def duplicate_end_of_stream(self, i: int) -> None:
        import grpc

        body = json.dumps(
            {"model": self.model, "messages": [{"role": "user", "content": f"dup {i}"}]}
        ).encode()
        channel = self._channel()
        call = self._stub(channel).Process()
        replies = 0
        messages = [
            headers_request(self.target, i),
            body_request(body, end_of_stream=True),
            body_request(body, end_of_stream=True),
            body_request(b"", end_of_stream=True),
        ]
        try:
            async with asyncio.timeout(10):
                ended = await self._write_all(call, messages)
                if not ended:
                    await call.done_writing()
                while (await call.read()) is not grpc.aio.EOF:
                    replies += 1
            status = f"{(await call.code()).name} after {replies} replies"
            if ended:
                status += " (" + ended.split(":")[0] + ")"
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            status = f"{e.code().name if isinstance(e, grpc.aio.AioRpcError) else 'InvalidState'}"
            status += f" after {replies} replies"
        except TimeoutError:
            call.cancel()
            status = f"no end after {replies} replies (10 s)"
        finally:
            await channel.close(grace=None)
        self.tally.add("duplicate end_of_stream", status)

    async def undecodable_message(self, i: int) -> None:
        import grpc

        channel = self._channel()
        raw = channel.stream_stream(PROCESS_METHOD)  # no serializers: bytes go as they are
        garbage = (b"\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\xff\xff", b"\x12\x05abc")[i % 3]
        try:
            async with asyncio.timeout(10):
                call = raw(iter([garbage]))
                async for _ in call:
                    pass
                status = (await call.code()).name
        except grpc.aio.AioRpcError as e:
            status = e.code().name
        except TimeoutError:
            status = "no answer (10 s)"
        finally:
            await channel.close(grace=None)
        self.tally.add("undecodable message", status)

    async def malformed_frames(self, i: int) -> None:
        """Hand-built HTTP/2 on a plain socket: broken gRPC framing inside a valid request."""
        variant, frames = _malformed_variant(i, f"127.0.0.1:{self.port}")
        status = await _exchange_raw(self.port, frames)
        self.tally.add(f"malformed gRPC frame: {variant}", status)

    async def close(self) -> None:
        """Count every held stream's outcome in the tally, cancel them and close every channel.

        grpc.aio keeps a closed channel's TCP connection until the channel object is collected, so
        the references go too (and a collection runs): the EPP then sees its clients leave.
        """
        for kind, helds in self.held.items():
            for held in helds:
                self.tally.add(kind, held.outcome or "open until the client left")
                if not held.outcome:
                    held.call.cancel()
            helds.clear()
        await asyncio.sleep(0)
        for channel in self._channels:
            await channel.close(grace=None)
        self._channels.clear()
        gc.collect()

    def open_count(self) -> int:
        return sum(1 for hs in self.held.values() for h in hs if not h.outcome)


# ------------------------------------------------------------------------------ raw HTTP/2

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _GOAWAY = 0, 1, 3, 4, 7
_END_STREAM, _END_HEADERS = 0x1, 0x4
_FRAME_NAMES = {0: "DATA", 1: "HEADERS", 3: "RST_STREAM", 4: "SETTINGS", 6: "PING", 7: "GOAWAY", 8: "WINDOW"}


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_literal(name: str, value: str) -> bytes:
    """A literal header field without indexing, new name, no Huffman (both shorter than 127)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _grpc_request_headers(authority: str) -> bytes:
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PROCESS_METHOD),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    return _frame(_HEADERS, _END_HEADERS, 1, b"".join(_hpack_literal(k, v) for k, v in fields))


def _malformed_variant(i: int, authority: str) -> tuple[str, bytes]:
    start = _PREFACE + _frame(_SETTINGS, 0, 0, b"") + _grpc_request_headers(authority)
    variants: list[tuple[str, bytes]] = [
        ("length prefix 2 GiB", _frame(_DATA, _END_STREAM, 1, b"\x00\x7f\xff\xff\xff" + b"abc")),
        ("truncated message", _frame(_DATA, _END_STREAM, 1, b"\x00\x00\x00\x00\x64" + b"\x0a\x02")),
        ("compressed flag, no encoding", _frame(_DATA, _END_STREAM, 1, b"\x01\x00\x00\x00\x03abc")),
        ("bad frame on stream 0", _frame(_DATA, 0, 0, b"\x00\x00\x00\x00\x00")),
    ]
    if i % (len(variants) + 1) == len(variants):
        return "not HTTP/2 at all", b"GET / HTTP/1.0\r\n\r\n" + bytes(random.Random(i).randbytes(512))
    name, tail = variants[i % (len(variants) + 1)]
    return name, start + tail


async def _exchange_raw(port: int, data: bytes, timeout: float = 5.0) -> str:
    """Send ``data``, read until the server closes or ``timeout``; say which frames came back."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, TimeoutError) as e:
        return f"connect failed: {_error_name(e)}"
    received = b""
    try:
        writer.write(data)
        await writer.drain()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
            if _closes_stream(received):
                break
    except OSError as e:
        return f"connection error: {_error_name(e)}"
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 2)
        except (OSError, TimeoutError):
            pass
    kinds = _frame_kinds(received)
    if not received:
        return "closed without a reply"
    if "GOAWAY" in kinds:
        return "GOAWAY"
    if "RST_STREAM" in kinds:
        return "RST_STREAM"
    if "HEADERS" in kinds:
        return "answered (HEADERS)"
    return "no answer: " + ",".join(dict.fromkeys(kinds))


def _frame_kinds(data: bytes) -> list[str]:
    kinds, pos = [], 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        kinds.append(_FRAME_NAMES.get(data[pos + 3], f"type-{data[pos + 3]}"))
        pos += 9 + length
    return kinds


def _closes_stream(data: bytes) -> bool:
    pos = 0
    while pos + 9 <= len(data):
        length, kind, flags = int.from_bytes(data[pos : pos + 3], "big"), data[pos + 3], data[pos + 4]
        if kind in (_GOAWAY, _RST_STREAM) or (kind == _HEADERS and flags & _END_STREAM):
            return True
        pos += 9 + length
    return False
