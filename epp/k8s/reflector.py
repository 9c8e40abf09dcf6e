"""A reflector: a local copy of one kind in one namespace, kept current by list-then-watch."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Protocol

import aiohttp
import orjson
import structlog
from kubernetes_asyncio import client

from epp.background import BackgroundTask
from epp.k8s.resources import ApiError, Kind, call, name_of, read_json, status_error, version_of

log = structlog.get_logger("epp.k8s")

BACKOFF_MIN = 0.2
BACKOFF_MAX = 10.0
MISSING_RETRY = 30.0  # a kind whose CRD is not installed is looked for again this often
WATCH_TIMEOUT = (240, 360)  # server-side watch timeout range in seconds (jittered so replicas spread)
# A watch silent for this long is treated as dead and resumed from its resourceVersion: API servers
# send bookmarks about once a minute, so a healthy idle watch is never cut, and a connection that
# died without a FIN (a vanished node, a NAT timeout) is noticed in 90 s, not at the 4-6 min end.
WATCH_SILENCE = 90.0
QUICK_WATCH_END = 1.0  # a watch ending sooner than this without any event counts as a failure
# Lists: a stalled API server or a half-open pooled connection must not hang discovery forever.
LIST_TIMEOUT = aiohttp.ClientTimeout(total=120, connect=10, sock_connect=10, sock_read=30)


class ReflectorHandler(Protocol):
    def on_upsert(self, obj: dict[str, Any]) -> None: ...

    def on_delete(self, obj: dict[str, Any]) -> None: ...

    def on_synced(self) -> None: ...


def _trim(obj: dict[str, Any]) -> dict[str, Any]:
    """Drop ``metadata.managedFields`` (server-side-apply bookkeeping, often most of an object's size)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class Reflector:
    """List, then watch; the handler is called from this one task, in the server's order.

    1. List in pages (a ``410`` on a continue token restarts the list) and diff the result against
       the local copy: gone objects are reported deleted, new or changed ones (by
       ``resourceVersion``) upserted, so a relist never duplicates or loses an object; then
       ``on_synced()``.
    2. Watch from the list's version with bookmarks and a 4 to 6 min server-side timeout; replays of
       a version already held are skipped. A clean end re-watches at once.
    3. A dropped connection or server error re-watches after backoff (0.2 s doubling to 10 s, ±20 %
       jitter, reset by a healthy watch); ``410 Gone`` goes back to step 1; ``404`` (CRD not
       installed) and ``403`` (RBAC) are logged as such and retried.

    ``restart(label_selector=...)`` changes the selector: the next list's diff removes what no longer
    matches.
    """

    def __init__(
        self,
        api: client.ApiClient,
        kind: Kind,
        namespace: str,
        handler: ReflectorHandler,
        *,
        label_selector: str = "",
        field_selector: str = "",
        page_size: int = 500,
        watch_timeout: tuple[int, int] = WATCH_TIMEOUT,
    ) -> None:
        self.api = api
        self.kind = kind
        self.namespace = namespace
        self.handler = handler
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.page_size = page_size
        self.watch_timeout = watch_timeout
        self.cache: dict[str, dict[str, Any]] = {}
        self.resource_version = ""
        self.synced = False
        self.lists = 0  # completed lists (first sync + relists), for logs and tests
        self.last_error = ""
        self._task = BackgroundTask(f"reflector-{kind.plural}", self._run)
        self._rng = random.Random()
        self._log = log.bind(kind=kind.kind, namespace=namespace)

    def _key(self, obj: dict[str, Any]) -> str:
        """The cache key: the name, or ``namespace/name`` when every namespace is watched."""
        if self.namespace:
            return name_of(obj)
        return f"{(obj.get('metadata') or {}).get('namespace', '')}/{name_of(obj)}"

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def restart(self, *, label_selector: str | None = None) -> None:
        """Apply a new selector: stop the watch and list again (the diff removes non-matching objects)."""
        await self.stop()
        if label_selector is not None:
            self.label_selector = label_selector
        self.resource_version = ""
        self.synced = False
        self.start()

    # --- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                if not self.resource_version:
                    await self._list()
                    failures = 0
                started = time.monotonic()
                if await self._watch():
                    failures = 0
                elif time.monotonic() - started < QUICK_WATCH_END:
                    # ended at once without a single event (a proxy cutting watches?): don't spin
                    failures += 1
                    await asyncio.sleep(self._backoff(failures))
            except asyncio.CancelledError:
                raise
            except _Gone as e:
                self._log.info("watch version expired, listing again", detail=str(e))
                self.resource_version = ""
                continue
            except ApiError as e:
                failures += 1
                self.last_error = str(e)
                if e.status == 410:  # an expired list continue token or watch version
                    self.resource_version = ""
                    continue
                if e.status == 404:
                    self._log.warning(
                        "resource not available (CRD not installed?); retrying",
                        error=str(e),
                        retry_s=MISSING_RETRY,
                    )
                    await asyncio.sleep(MISSING_RETRY)
                    continue
                if e.status in (401, 403):
                    self._log.error(
                        "not allowed to list/watch; check the service account's RBAC", error=str(e)
                    )
                else:
                    self._log.warning("list/watch failed", error=str(e))
                await asyncio.sleep(self._backoff(failures))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
                failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._log.info("watch connection lost; reconnecting", error=self.last_error, attempt=failures)
                await asyncio.sleep(self._backoff(failures))
            except Exception as e:  # never let the loop die: a dead reflector would freeze the pool
                failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._log.exception("unexpected list/watch failure; listing again", error=self.last_error)
                self.resource_version = ""
                await asyncio.sleep(self._backoff(failures))

    def _backoff(self, failures: int) -> float:
        delay = min(BACKOFF_MAX, BACKOFF_MIN * (2 ** max(0, failures - 1)))
        return delay * self._rng.uniform(0.8, 1.2)

    def _params(self) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if self.label_selector:
            params["label_selector"] = self.label_selector
        if self.field_selector:
            params["field_selector"] = self.field_selector
        return params

    async def _list(self) -> None:
        items: dict[str, dict[str, Any]] = {}
        version = ""
        token = ""
        while True:
            params = self._params()
            params["limit"] = self.page_size
            if token:
                params["_continue"] = token
            params["_request_timeout"] = LIST_TIMEOUT
            page = await read_json(await call(self.api, self.kind, self.namespace, **params))
            meta = page.get("metadata") or {}
            if not version:
                version = str(meta.get("resourceVersion", ""))
            for obj in page.get("items") or ():
                if isinstance(obj, dict) and name_of(obj):
                    items[self._key(obj)] = _trim(obj)
            token = str(meta.get("continue") or "")
            if not token:
                break
        if not version:
            raise ApiError(500, "list response has no resourceVersion")
        self._replace(items)
        self.resource_version = version
        self.lists += 1
        self.synced = True
        self.last_error = ""
        self._log.debug("listed", count=len(items), resource_version=version)
        self._call("on_synced")

    def _replace(self, items: dict[str, dict[str, Any]]) -> None:
        old, self.cache = self.cache, items
        for name, obj in old.items():
            if name not in items:
                self._call("on_delete", obj)
        for name, obj in items.items():
            prev = old.get(name)
            if prev is None or version_of(prev) != version_of(obj):
                self._call("on_upsert", obj)

    async def _watch(self) -> bool:
        """Watch until the stream ends; True when it delivered anything (a healthy connection)."""
        timeout = self._rng.randint(*self.watch_timeout)
        params = self._params()
        resp = await call(
            self.api,
            self.kind,
            self.namespace,
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=aiohttp.ClientTimeout(connect=10, sock_connect=10, sock_read=WATCH_SILENCE),
            **params,
        )
        healthy = False
        try:
            if resp.status == 410:
                raise _Gone(f"HTTP 410 for resourceVersion {self.resource_version}")
            if not 200 <= resp.status < 300:
                raise status_error(resp.status, await resp.read())
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    line = bytes(buf[start:end])
                    start = end + 1
                    if line.strip():
                        self._event(line)
                        healthy = True
                del buf[:start]
            if buf.strip():  # a last event without its newline: a stream cut mid-event
                raise aiohttp.ClientPayloadError("watch stream ended inside an event")
        finally:
            resp.release()
        return healthy

    def _event(self, line: bytes) -> None:
        event = orjson.loads(line)
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, dict):
            raise ValueError(f"watch event without an object: {line[:200]!r}")
        if kind == "ERROR":
            code = int(obj.get("code") or 0)
            if code == 410:
                raise _Gone(str(obj.get("message", "")))
            raise ApiError(code or 500, str(obj.get("message", "")), str(obj.get("reason", "")))
        version = version_of(obj)
        if kind == "BOOKMARK":
            if version:
                self.resource_version = version
            return
        name = self._key(obj)
        _trim(obj)
        if kind in ("ADDED", "MODIFIED"):
            prev = self.cache.get(name)
            if prev is None or version_of(prev) != version:
                self.cache[name] = obj
                self._call("on_upsert", obj)
        elif kind == "DELETED":
            prev = self.cache.pop(name, None)
            if prev is not None:
                self._call("on_delete", obj)
        else:
            self._log.warning("unknown watch event type", type=kind)
        if version:
            self.resource_version = version

    def _call(self, method: str, *args: Any) -> None:
        """A handler failure is logged and never stops the watch (one bad object must not blind us)."""
        try:
            getattr(self.handler, method)(*args)
        except Exception as e:
            self._log.error(
                "handler failed", method=method, object=name_of(args[0]) if args else "", error=repr(e)
            )
