"""The ``vllm`` backend of ``token-producer``: a model server's render endpoints over HTTP.

``POST {url}/v1/chat/completions/render`` answers one object with ``token_ids`` (and multimodal
``features``); ``POST {url}/v1/completions/render`` a list of them, one per prompt. One aiohttp
session (one connection pool) serves every request of a plugin instance. Results are cached by a
digest of the rendered inputs (bounded by entries and by token ids held), and concurrent identical
renders share one call. A failure (timeout, refused connection, non-2xx status, undecodable
answer) gives no tokens: it is counted per reason and logged at most a few times per interval.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import structlog
import xxhash

from epp import promlite

CHAT_RENDER_PATH = "/v1/chat/completions/render"
COMPLETIONS_RENDER_PATH = "/v1/completions/render"
DEFAULT_URL = "http://localhost:8000"
DEFAULT_TIMEOUT = 5.0
DEFAULT_MM_TIMEOUT = 30.0
CACHE_MAX_ENTRIES = 4096
CACHE_MAX_TOKENS = 2_000_000  # ids held by the cache (about 36 bytes each as Python ints)
POOL_LIMIT = 64  # connections to the render server
_LOG_BURST = 5
_LOG_INTERVAL = 10.0
_ERROR_SNIPPET = 256

# Top-level request fields that do not change the rendered prompt; left out of the cache digest so
# that a retry with other sampling settings reuses the render.
_SAMPLING_FIELDS = frozenset(
    {
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "stop",
        "seed",
        "user",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "priority",
        "request_id",
        "metadata",
    }
)

RENDER_FAILURES = promlite.Counter(
    "llm_d_epp_token_producer_render_failures_total",
    "Render calls of a token-producer's vllm backend that gave no tokens, per reason "
    "(timeout, connect, status, decode).",
    ["plugin_name", "reason"],
)
RENDER_CACHE = promlite.Counter(
    "llm_d_epp_token_producer_render_cache_total",
    "Renders of a token-producer's vllm backend answered from its cache (hit) or by the server (miss).",
    ["plugin_name", "result"],
)
promlite.register(RENDER_FAILURES, RENDER_CACHE, owners=("token-producer",))

log = structlog.get_logger("epp.token_producer")


class RenderError(Exception):
    """A render call that gave no tokens; ``reason`` is a bounded metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True, frozen=True)
class Rendered:
    """A render's token ids and multimodal items ``(hash, offset, length)``, sorted by offset."""

    token_ids: list[int]
    mm_items: tuple[tuple[str, int, int], ...] = ()


class _RateLog:
    """At most ``_LOG_BURST`` warnings per ``_LOG_INTERVAL`` seconds; the rest are counted."""

    __slots__ = ("logged", "start", "suppressed")

    def __init__(self) -> None:
        self.start = 0.0
        self.logged = 0
        self.suppressed = 0

    def warn(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self.start >= _LOG_INTERVAL:
            if self.suppressed:
                fields["suppressed_before"] = self.suppressed
            self.start, self.logged, self.suppressed = now, 0, 0
        if self.logged >= _LOG_BURST:
            self.suppressed += 1
            return
        self.logged += 1
        log.warning(event, **fields)


class RenderClient:
    """Calls one render server for one model; ``render`` returns None on failure (never raises)."""

    def __init__(
        self,
        plugin_name: str,
        base_url: str,
        model: str,
        timeout: float,
        mm_timeout: float,
        *,
        max_entries: int = CACHE_MAX_ENTRIES,
        max_tokens: int = CACHE_MAX_TOKENS,
    ) -> None:
        self.base_url = base_url.rstrip("/") or DEFAULT_URL
        self.model = model
        self.timeout = timeout
        self.mm_timeout = mm_timeout
        self._plugin = plugin_name
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cache: OrderedDict[bytes, Rendered] = OrderedDict()
        self._cache_tokens = 0
        self._max_entries = max_entries
        self._max_tokens = max_tokens
        self._inflight: dict[bytes, asyncio.Future[Rendered | None]] = {}
        self._hits = RENDER_CACHE.labels(plugin_name, "hit")
        self._misses = RENDER_CACHE.labels(plugin_name, "miss")
        self._log = _RateLog()
        self._told_scale_out = False

    # --- the request path -------------------------------------------------------------------------

    async def render(self, path: str, payload: Mapping[str, Any], multimodal: bool) -> Rendered | None:
        """The render of ``payload`` (the client's request body) at ``path``; None on failure."""
        body = dict(payload)
        body["model"] = self.model  # a render server requires its base model's name
        key = self._digest(path, body)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self._hits.value += 1
            return cached
        pending = self._inflight.get(key)
        if pending is not None:  # an identical render is on its way: share it
            self._hits.value += 1
            return await asyncio.shield(pending)
        self._misses.value += 1
        fut: asyncio.Future[Rendered | None] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        result: Rendered | None = None
        try:
            result = await self._post(path, body, self.mm_timeout if multimodal else self.timeout)
        except RenderError as e:
            RENDER_FAILURES.labels(self._plugin, e.reason).value += 1
            self._log.warn("token-producer render failed", plugin=self._plugin, reason=e.reason, error=str(e))
        finally:
            del self._inflight[key]
            if not fut.done():
                fut.set_result(result)
        if result is not None:
            self._remember(key, result)
        return result

    @staticmethod
    def _digest(path: str, body: dict[str, Any]) -> bytes:
        inputs = {k: v for k, v in body.items() if k not in _SAMPLING_FIELDS}
        h = xxhash.xxh3_128(path.encode())
        h.update(orjson.dumps(inputs, option=orjson.OPT_NON_STR_KEYS))
        return h.digest()

    def _remember(self, key: bytes, result: Rendered) -> None:
        n = len(result.token_ids)
        if n > self._max_tokens or self._max_entries <= 0:
            return
        cache = self._cache
        cache[key] = result
        self._cache_tokens += n
        while len(cache) > self._max_entries or self._cache_tokens > self._max_tokens:
            _, old = cache.popitem(last=False)
            self._cache_tokens -= len(old.token_ids)

    def cache_size(self) -> tuple[int, int]:
        """(entries, token ids) held by the cache."""
        return len(self._cache), self._cache_tokens

    # --- HTTP ---------------------------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._session
        if session is None or session.closed or self._loop is not loop:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=POOL_LIMIT, keepalive_timeout=90.0),
                headers={"Content-Type": "application/json"},
            )
            self._loop = loop
        return session

    async def _post(self, path: str, body: dict[str, Any], timeout: float) -> Rendered:
        try:
            data = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        except TypeError as e:
            raise RenderError("decode", f"cannot encode the render request: {e}") from e
        url = self.base_url + path
        try:
            async with self._client().post(
                url, data=data, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError as e:
            raise RenderError("timeout", f"POST {url}: no answer within {timeout:g}s") from e
        except aiohttp.ClientError as e:
            raise RenderError("connect", f"POST {url}: {e}") from e
        except OSError as e:
            raise RenderError("connect", f"POST {url}: {e}") from e
        if status == 403:
            self._refused(url)
        if status < 200 or status >= 300:
            snippet = raw[:_ERROR_SNIPPET].decode("utf-8", "replace")
            raise RenderError("status", f"POST {url}: status {status}: {snippet}")
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise RenderError("decode", f"POST {url}: answer is not JSON: {e}") from e
        return _parse_answer(answer, url, path == COMPLETIONS_RENDER_PATH)

    def _refused(self, url: str) -> None:
        """vLLM 0.32 serves its render endpoints only with ``--enable-scale-out``: say so once."""
        if self._told_scale_out:
            return
        self._told_scale_out = True
        log.warning(
            "token-producer: the render server refuses (403): start vLLM with --enable-scale-out "
            "(vLLM 0.32 serves its render endpoints only then); until it does, requests get no token "
            "ids and no precise prefix match",
            plugin=self._plugin,
            url=url,
        )

    async def probe(self) -> None:
        """One small render at start-up, so that a refusing server is named before traffic comes."""
        try:
            await self._post(COMPLETIONS_RENDER_PATH, {"model": self.model, "prompt": "a"}, self.timeout)
        except RenderError:
            pass  # a server not up yet, or an error a request will report; only a 403 is named

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


def _token_ids(obj: Any, url: str) -> list[int]:
    ids = obj.get("token_ids") if isinstance(obj, dict) else None
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise RenderError("decode", f"POST {url}: answer has no token_ids list of non-negative integers")
    return ids


def _mm_items(obj: dict[str, Any], offset: int) -> list[tuple[str, int, int]]:
    features = obj.get("features")
    if not isinstance(features, dict):
        return []
    hashes, places = features.get("mm_hashes"), features.get("mm_placeholders")
    if not isinstance(hashes, dict) or not isinstance(places, dict):
        return []
    items: list[tuple[str, int, int]] = []
    for modality, hs in hashes.items():
        ranges = places.get(modality)
        if not isinstance(hs, list) or not isinstance(ranges, list):
            continue
        for h, r in zip(hs, ranges, strict=False):
            if isinstance(h, str) and isinstance(r, dict):
                off, length = r.get("offset"), r.get("length")
                if isinstance(off, int) and isinstance(length, int):
                    items.append((h, off + offset, length))
    return items


def _parse_answer(answer: Any, url: str, is_list: bool) -> Rendered:
    """A chat render's object, or a completions render's list (its prompts' ids concatenated)."""
    if not is_list:
        ids = _token_ids(answer, url)
        return Rendered(ids, tuple(sorted(_mm_items(answer, 0), key=lambda i: i[1])))
    if not isinstance(answer, list) or not answer:
        raise RenderError("decode", f"POST {url}: answer is not a non-empty list")
    if len(answer) == 1:
        return Rendered(_token_ids(answer[0], url))
    out: list[int] = []
    for item in answer:
        out += _token_ids(item, url)
    return Rendered(out)
