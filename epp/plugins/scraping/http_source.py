"""The HTTP(S) polling shared by the ``*-data-source`` plugins: parameters, TLS, one connection per endpoint.

``HttpDataSource`` turns an endpoint into a target (its metrics host, or its pod/node address with
a ``port`` override) and hands out ``HttpPoller``s: keep-alive HTTP/1.1 GETs returning the body.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any

from epp.framework import ConfigError, DataSource, Endpoint
from epp.framework.durations import parse_go_duration
from epp.framework.interfaces import Handle, PollError

_MAX_BODY = 16 << 20
_MAX_HEAD = 64 << 10
_CONNECT_TIMEOUT = 10.0  # the reference client's timeout; each poll is bounded by the scraper too
PROMETHEUS_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"


class HttpError(PollError):
    """A failed poll: ``reason`` ``http_status`` (not 200), ``connect`` (the connection closed
    before a response) or ``malformed_response`` (anything unparsable or too large)."""

    def __init__(self, message: str, reason: str = "malformed_response") -> None:
        super().__init__(message, reason)


def validate_http_params(params: Any) -> str | None:
    """The shared checks of an HTTP source's parameters: scheme, path, interval, TLS files, port."""
    if params.scheme not in ("http", "https"):
        return f"scheme: unsupported scheme: {params.scheme!r} (must be 'http' or 'https')"
    if not params.path.startswith("/"):
        return f"path: must start with '/', got {params.path!r}"
    interval = getattr(params, "interval", "")
    if interval:
        seconds = parse_go_duration(interval)
        if seconds is None:
            return f'interval: invalid interval {interval!r}: not a duration such as "1s"'
        if seconds < 0:
            return f"interval: interval must be non-negative, got {interval}"
    port = getattr(params, "port", None)
    if port is not None and not 1 <= port <= 65535:
        return f"port: invalid port {port}: must be between 1 and 65535"
    if params.scheme != "https":
        return None  # TLS settings are read only for https (as the reference does)
    files = ["client_cert_path", "client_key_path"]
    if not params.insecure_skip_verify:
        files.insert(0, "ca_cert_path")  # the CA bundle is used only when verifying
    for field in files:
        path = getattr(params, field, "")
        if path and not os.path.isfile(path):
            return f"{_camel(field)}: no such file {path!r}"
    cert, key = getattr(params, "client_cert_path", ""), getattr(params, "client_key_path", "")
    if bool(cert) != bool(key):
        return "clientCertPath: clientCertPath and clientKeyPath must be set together"
    return None


class HttpDataSource(DataSource):
    """Base of the HTTP sources: ``poller(endpoint)`` GETs ``scheme://target/path``.

    The target is the endpoint's metrics host, or with a ``port`` override its address (its node's
    with ``use_node_address``) and that port. Subclasses set ``accept`` and may parse the body in
    ``parse`` (raise ``HttpError`` for a malformed one).
    """

    accept: str = PROMETHEUS_ACCEPT

    def __init__(self, name: str, params: Any, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._scheme: str = params.scheme
        self._path: str = params.path
        self._port: int | None = getattr(params, "port", None)
        self._use_node_address: bool = bool(getattr(params, "use_node_address", False))
        interval = getattr(params, "interval", "")
        seconds = parse_go_duration(interval) if interval else None
        self.interval = seconds if seconds else None  # 0 / omitted: every base tick
        self._ssl: ssl.SSLContext | None = None
        if params.scheme == "https":
            self._ssl = client_ssl_context(
                params.insecure_skip_verify,
                getattr(params, "ca_cert_path", ""),
                getattr(params, "client_cert_path", ""),
                getattr(params, "client_key_path", ""),
            )

    def target(self, endpoint: Endpoint) -> tuple[str, int]:
        """The host and port polled for ``endpoint``."""
        meta = endpoint.metadata
        if self._port is not None:
            host = meta.address
            if self._use_node_address and meta.node_address:
                host = meta.node_address
            return host, self._port
        return split_hostport(meta.metrics_hostport)

    def url(self, endpoint: Endpoint) -> str:
        host, port = self.target(endpoint)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return f"{self._scheme}://{authority}{self._path}"

    def poller(self, endpoint: Endpoint) -> HttpPoller:
        """A poller bound to ``endpoint``'s target; close it when the endpoint goes away."""
        host, port = self.target(endpoint)
        return HttpPoller(host, port, self._path, self._ssl, self.accept, self.parse)

    def parse(self, body: bytes) -> Any:
        return body


class HttpPoller:
    """One keep-alive HTTP/1.1 connection to one host; ``poll`` calls must not overlap.

    Handles ``Content-Length``, chunked and read-until-close bodies; a reused connection the server
    closed is retried once on a fresh one. A cancelled or failed poll closes the connection, so a
    half-read response never corrupts the next. Far cheaper per scrape than an aiohttp session.
    """

    __slots__ = ("_host", "_parse", "_port", "_reader", "_request", "_ssl", "_writer")

    def __init__(
        self,
        host: str,
        port: int,
        path: str,
        ssl_context: ssl.SSLContext | None,
        accept: str = PROMETHEUS_ACCEPT,
        parse: Any = None,
    ) -> None:
        self._host = host
        self._parse = parse
        self._port = port
        self._ssl = ssl_context
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: epp\r\nAccept: {accept}\r\n\r\n"
        ).encode("latin-1")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def poll(self) -> Any:
        """GET the page; returns the (parsed) body of a 200 response or raises."""
        body = await self._get()
        return body if self._parse is None else self._parse(body)

    async def _get(self) -> bytes:
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


def split_hostport(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def client_ssl_context(
    insecure_skip_verify: bool, ca_cert_path: str = "", client_cert_path: str = "", client_key_path: str = ""
) -> ssl.SSLContext:
    """Verify with the system roots (or ``ca_cert_path``) unless skipped; present a client cert if set."""
    try:
        if insecure_skip_verify:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(cafile=ca_cert_path or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError("caCertPath", f"no valid CA certs in {ca_cert_path!r}: {e}") from e
    if client_cert_path or client_key_path:
        try:
            context.load_cert_chain(client_cert_path, client_key_path)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError("clientCertPath", f"loading client cert: {e}") from e
    return context


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)
