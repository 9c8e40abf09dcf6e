"""The sidecar's aiohttp application: P/D for ``/v1/completions`` and ``/v1/chat/completions``,
every other request passed through to the decode engine.

A request without ``x-prefiller-host-port`` goes to the decode engine unchanged. With it: a malformed
header is answered 400; with SSRF protection an endpoint outside the allow-list 403; otherwise the
connector's protocol runs. A ``nixlv2`` prefill that cannot be used (unreachable, timed out, an error
status, an answer without ``kv_transfer_params``) is counted and the request is served decode-only:
a prefill failure never loses a request. Answers are streamed through as they arrive, never buffered.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web
from multidict import CIMultiDict

from epp.log_limit import LogLimiter
from epp.sidecar import connectors
from epp.sidecar.allowlist import AllowList
from epp.sidecar.metrics import STAGE_DECODE, STAGE_PREFILL, SidecarMetrics
from epp.sidecar.target import PREFILL_HEADER, Target, TargetError, choose, parse_header

log = structlog.get_logger("epp.sidecar")
# Clients and a dead prefiller can trigger these lines on every request: a few per cause per 10 s.
_LOGS = LogLimiter()

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_PREFILL_ANSWER_BYTES = 16 * 1024 * 1024
_HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        PREFILL_HEADER,
    )
)
API_TYPES = {"/v1/completions": "completions", "/v1/chat/completions": "chat-completions"}


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    decoder_url: str = "http://127.0.0.1:8200"
    connector: str = connectors.NIXLV2
    prefiller_sampling: bool = False
    prefill_timeout: float = 60.0
    """Seconds for the whole prefill exchange (a long prompt's prefill included)."""
    connect_timeout: float = 5.0
    decode_read_timeout: float = 600.0
    """Seconds the decode engine may stay silent (between two chunks) before the request fails."""
    sglang_bootstrap_port: int = connectors.DEFAULT_SGLANG_BOOTSTRAP_PORT


class _Fallback(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _error(status: int, message: str, error_type: str) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _forward_headers(headers: Any) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


class Sidecar:
    """The proxy's state: its config, HTTP sessions, allow-list (``None``: SSRF protection off)."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        allow: AllowList | None = None,
        metrics: SidecarMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.allow = allow
        self.metrics = metrics or SidecarMetrics()
        self.rng = rng or random.Random()
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[None]] = set()

    # --- lifecycle -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        for path in API_TYPES:
            app.router.add_post(path, self.inference)
        app.router.add_route("*", "/{path:.*}", self.passthrough)
        return app

    async def _open(self, _: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=30)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def _close(self, _: web.Application) -> None:
        for task in list(self._background):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the sidecar app is not started"
        return self._session

    # --- handlers --------------------------------------------------------------------------------

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        body = await request.read() if request.can_read_body else None
        return await self._to_decoder(request, body, connector="")

    async def inference(self, request: web.Request) -> web.StreamResponse:
        self.metrics.requests.labels(API_TYPES[request.path]).inc()
        raw = await request.read()
        try:
            targets = parse_header(request.headers.getall(PREFILL_HEADER, []))
        except TargetError as e:
            self.metrics.bad_requests.labels("header").inc()
            return _error(400, f"malformed {PREFILL_HEADER} header: {e}", "BadRequestError")
        if not targets:
            return await self._to_decoder(request, raw, connector="")
        target = choose(targets, sample=self.config.prefiller_sampling, rng=self.rng)
        if self.allow is not None and not self.allow.ready:
            # the pool is not known yet: call nothing, serve decode-only
            self.metrics.decode_only_fallbacks.labels("allowlist_not_ready").inc()
            _LOGS.log(log.warning, "pd_allowlist_not_ready", "prefill allow-list not ready; decode-only")
            return await self._to_decoder(request, raw, connector="")
        if self.allow is not None and not self.allow.allows(target):
            self.metrics.ssrf_denied.inc()
            _LOGS.log(
                log.warning,
                "pd_ssrf_denied",
                "prefill endpoint refused: not in the pool",
                target=target.hostport,
                client=request.remote,
            )
            return _error(
                403,
                f"prefill endpoint {target.hostport} is not a prefill endpoint of the pool (SSRF protection)",
                "PermissionDeniedError",
            )
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            self.metrics.bad_requests.labels("body").inc()
            return _error(400, f"Invalid JSON body: {e}", "BadRequestError")
        if not isinstance(body, dict):
            self.metrics.bad_requests.labels("body").inc()
            return _error(400, "The request body must be a JSON object", "BadRequestError")
        connector = self.config.connector
        self.metrics.disagg_requests.labels(connector).inc()
        if connector == connectors.SGLANG:
            return await self._sglang(request, body, target)
        return await self._prefill_then_decode(request, raw, body, target)

    # --- nixlv2, shared-storage ------------------------------------------------------------------

    async def _prefill_then_decode(
        self, request: web.Request, raw: bytes, body: dict[str, Any], target: Target
    ) -> web.StreamResponse:
        connector = self.config.connector
        nixl = connector == connectors.NIXLV2
        chat = request.path.endswith("/chat/completions")
        if nixl:
            prefill = orjson.dumps(connectors.nixl_prefill_body(body, chat=chat))
        else:
            prefill = orjson.dumps(connectors.single_token_body(body, chat=chat))
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            answer = await self._prefill(request, target, prefill)
            params = connectors.nixl_transfer_params(answer) if nixl else {}
        except connectors.PrefillResponseError as e:
            return await self._decode_only(request, raw, target, _Fallback("invalid_response", str(e)))
        except _Fallback as f:
            return await self._decode_only(request, raw, target, f)
        self.metrics.prefill_duration.labels(connector).observe(loop.time() - start)
        self.metrics.prefilled_requests.labels(connector).inc()
        decode = orjson.dumps(connectors.nixl_decode_body(body, params)) if nixl else raw
        return await self._to_decoder(request, decode, connector=connector)

    async def _decode_only(
        self, request: web.Request, raw: bytes, target: Target, failure: _Fallback
    ) -> web.StreamResponse:
        connector = self.config.connector
        self.metrics.errors.labels(connector, STAGE_PREFILL).inc()
        self.metrics.decode_only_fallbacks.labels(failure.reason).inc()
        _LOGS.log(
            log.warning,
            f"pd_prefill_{failure.reason}",
            "prefill failed; serving decode-only",
            target=target.hostport,
            error=str(failure),
        )
        return await self._to_decoder(request, raw, connector=connector)

    async def _prefill(self, request: web.Request, target: Target, body: bytes) -> object:
        headers = _forward_headers(request.headers)
        headers["Content-Type"] = "application/json"
        timeout = aiohttp.ClientTimeout(
            total=self.config.prefill_timeout, connect=self.config.connect_timeout
        )
        try:
            async with self.session.post(
                target.url + request.path_qs,
                data=body,
                headers=headers,
                timeout=timeout,
                auto_decompress=True,
            ) as resp:
                data = await _read_capped(resp, MAX_PREFILL_ANSWER_BYTES)
                if resp.status >= 300:
                    raise _Fallback("status", f"HTTP {resp.status}: {data[:200]!r}")
        except TimeoutError:
            raise _Fallback(
                "timeout", f"no prefill answer within {self.config.prefill_timeout:g} s"
            ) from None
        except (aiohttp.ClientError, OSError) as e:
            raise _Fallback("unreachable", repr(e)) from None
        try:
            answer: object = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise _Fallback("invalid_response", f"the prefill answer is not JSON: {e}") from None
        return answer

    # --- sglang ----------------------------------------------------------------------------------

    async def _sglang(self, request: web.Request, body: dict[str, Any], target: Target) -> web.StreamResponse:
        both = orjson.dumps(
            connectors.sglang_body(body, target.host, self.config.sglang_bootstrap_port, self.rng)
        )
        task = asyncio.get_running_loop().create_task(self._sglang_prefill(request, target, both))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await self._to_decoder(request, both, connector=connectors.SGLANG)

    async def _sglang_prefill(self, request: web.Request, target: Target, body: bytes) -> None:
        """The prefill half, concurrent with the decode: its answer is read and dropped."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        headers = _forward_headers(request.headers)
        headers["Content-Type"] = "application/json"
        timeout = aiohttp.ClientTimeout(
            total=self.config.prefill_timeout, connect=self.config.connect_timeout
        )
        try:
            async with self.session.post(
                target.url + request.path_qs, data=body, headers=headers, timeout=timeout
            ) as resp:
                await _read_capped(resp, MAX_PREFILL_ANSWER_BYTES)
                ok = resp.status < 300
        except (TimeoutError, aiohttp.ClientError, OSError, _Fallback) as e:
            _LOGS.log(
                log.warning,
                "pd_sglang_prefill",
                "sglang prefill failed",
                target=target.hostport,
                error=repr(e),
            )
            ok = False
        if ok:
            self.metrics.prefill_duration.labels(connectors.SGLANG).observe(loop.time() - start)
            self.metrics.prefilled_requests.labels(connectors.SGLANG).inc()
        else:
            self.metrics.errors.labels(connectors.SGLANG, STAGE_PREFILL).inc()

    # --- decode ----------------------------------------------------------------------------------

    async def _to_decoder(
        self, request: web.Request, body: bytes | None, *, connector: str
    ) -> web.StreamResponse:
        """Send the request to the decode engine and stream its answer back chunk by chunk."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.connect_timeout, sock_read=self.config.decode_read_timeout
        )
        headers = _forward_headers(request.headers)
        try:
            upstream = await self.session.request(
                request.method,
                self.config.decoder_url + request.path_qs,
                data=body,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            )
        except TimeoutError:
            self._decode_error(connector)
            return _error(504, "the decode engine did not answer in time", "GatewayTimeoutError")
        except (aiohttp.ClientError, OSError) as e:
            self._decode_error(connector)
            return _error(502, f"the decode engine is unreachable: {e}", "BadGatewayError")
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    response.headers.add(key, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (TimeoutError, aiohttp.ClientError) as e:
                self._decode_error(connector)
                log.warning("decode stream broken", error=repr(e))
                raise  # the client's connection is closed: a truncated answer is never passed as whole
            await response.write_eof()
        finally:
            upstream.release()
        if connector:
            self.metrics.decode_duration.labels(connector).observe(loop.time() - start)
        return response

    def _decode_error(self, connector: str) -> None:
        self.metrics.errors.labels(connector or "none", STAGE_DECODE).inc()


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _Fallback("invalid_response", f"the answer exceeds {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
