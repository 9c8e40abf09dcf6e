"""``metrics-data-source``: polls a model server's Prometheus metrics page over HTTP(S)."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from epp.framework import DataSource, Endpoint, register
from epp.framework.interfaces import Handle, PollError

_MAX_BODY = 16 << 20
_MAX_HEAD = 64 << 10
_CONNECT_TIMEOUT = 10.0  # the reference client's timeout; each poll is bounded by the scraper too


class HttpError(PollError):
    """A failed metrics poll: ``reason`` ``http_status`` (not 200), ``connect`` (the connection
    closed before a response) or ``malformed_response`` (anything unparsable or too large)."""

    def __init__(self, message: str, reason: str = "malformed_response") -> None:
        super().__init__(message, reason)


@dataclass(slots=True, frozen=True)
class MetricsDataSourceParams:
    scheme: str = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True

    def validate(self) -> str | None:
        if self.scheme not in ("http", "https"):
            return f"scheme: must be 'http' or 'https', got {self.scheme!r}"
        if not self.path.startswith("/"):
            return f"path: must start with '/', got {self.path!r}"
        return None


@register
class MetricsDataSource(DataSource):
    type_name = "metrics-data-source"
    Params = MetricsDataSourceParams

    def __init__(self, name: str, params: MetricsDataSourceParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.params: MetricsDataSourceParams = params
        self._ssl: ssl.SSLContext | None = None
        if params.scheme == "https":
            self._ssl = _client_ssl_context(params.insecure_skip_verify)

    def url(self, endpoint: Endpoint) -> str:
        return f"{self.params.scheme}://{endpoint.metadata.metrics_hostport}{self.params.path}"

    def poller(self, endpoint: Endpoint) -> MetricsPoller:
        """A poller bound to ``endpoint``'s metrics host; close it when the endpoint goes away."""
        host, port = _split_hostport(endpoint.metadata.metrics_hostport)
        return MetricsPoller(host, port, self.params.path, self._ssl)


class MetricsPoller:
    """One keep-alive HTTP/1.1 connection to one metrics host; ``poll`` calls must not overlap.

    Handles ``Content-Length``, chunked and read-until-close bodies; a reused connection the server
    closed is retried once on a fresh one. A cancelled or failed poll closes the connection, so a
    half-read response never corrupts the next. Far cheaper per scrape than an aiohttp session.
    """

    __slots__ = ("_host", "_port", "_reader", "_request", "_ssl", "_writer")

    def __init__(self, host: str, port: int, path: str, ssl_context: ssl.SSLContext | None) -> None:
        self._host = host
        self._port = port
        self._ssl = ssl_context
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: epp\r\n"
            "Accept: text/plain;version=0.0.4;q=1,*/*;q=0.1\r\n\r\n"
        ).encode("latin-1")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def poll(self) -> bytes:
        """GET the metrics page; returns the body of a 200 response or raises."""
        try:
            if self._writer is not None:
                try:
                    return await self._exchange()
                except _StaleConnection:
                    self.close()  # the server closed the idle connection: retry once, fresh
            await self._connect()
            try:
                return await self._exchange()
            except _StaleConnection as e:
                raise HttpError("connection closed before a response", "connect") from e
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._writer is not None:
            self._writer.transport.abort()
        self._reader = self._writer = None

    async def _connect(self) -> None:
        async with asyncio.timeout(_CONNECT_TIMEOUT):
            self._reader, self._writer = await asyncio.open_connection(
                self._host, self._port, ssl=self._ssl, limit=_MAX_HEAD
            )

    async def _exchange(self) -> bytes:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        writer.write(self._request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _StaleConnection from e
            raise HttpError("connection closed inside the response head") from e
        except (ConnectionResetError, BrokenPipeError) as e:
            raise _StaleConnection from e
        except asyncio.LimitOverrunError as e:
            raise HttpError("response head too large") from e
        status, length, chunked, keep_alive = _parse_head(head)
        if status < 200 or status in (204, 304):
            body = b""  # no body by definition (1xx responses are not expected for a GET)
        elif chunked:
            body = await _read_chunked(reader)
        elif length is not None:
            if length > _MAX_BODY:
                raise HttpError(f"response body too large ({length} bytes)")
            body = await reader.readexactly(length)
        else:
            body = await reader.read(_MAX_BODY + 1)
            while not reader.at_eof() and len(body) <= _MAX_BODY:
                body += await reader.read(_MAX_BODY + 1 - len(body))
            if len(body) > _MAX_BODY:
                raise HttpError("response body too large")
            keep_alive = False
        if not keep_alive:
            self.close()
        if status != 200:
            raise HttpError(f"unexpected status {status}", "http_status")
        return body


class _StaleConnection(Exception):
    """The connection was closed or reset before any response byte (retried once if it was reused)."""


def _parse_head(head: bytes) -> tuple[int, int | None, bool, bool]:
    """Status, content length, chunked, keep-alive from a response head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HttpError(f"malformed status line {lines[0][:80]!r}")
    try:
        status = int(parts[1])
    except ValueError as e:
        raise HttpError(f"malformed status line {lines[0][:80]!r}") from e
    keep_alive = parts[0] == b"HTTP/1.1"
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        key = name.strip().lower()
        if key == b"content-length":
            try:
                length = int(value)
            except ValueError as e:
                raise HttpError(f"malformed content-length {value[:40]!r}") from e
        elif key == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif key == b"connection":
            token = value.strip().lower()
            if token == b"close":
                keep_alive = False
            elif token == b"keep-alive":
                keep_alive = True
    return status, length, chunked, keep_alive


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError as e:
            raise HttpError(f"malformed chunk size {size_line[:40]!r}") from e
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        total += size
        if total > _MAX_BODY:
            raise HttpError("response body too large")
        chunk = await reader.readexactly(size + 2)
        parts.append(chunk[:-2])


def _split_hostport(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _client_ssl_context(insecure_skip_verify: bool) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
