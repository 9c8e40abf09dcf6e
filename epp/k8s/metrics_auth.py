"""``--metrics-endpoint-auth``: ``/metrics`` only for callers the cluster vouches for.

As the reference (controller-runtime's metrics filter): the request's bearer token is checked with
a TokenReview, then the user it names with a SubjectAccessReview for the non-resource URL (the
request's path, its method in lower case as the verb). No or an unknown token: 401; not allowed:
403; the API server unreachable: 500. Answers are cached per (token, path, verb): allowed ones for
5 minutes, refused ones for 30 s; failures are not cached. The metrics server's threads ask; the
reviews run on the event loop's API client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from kubernetes_asyncio import client

from epp.k8s.resources import read_json

log = structlog.get_logger("epp.metrics_auth")

ALLOWED_TTL = 300.0
DENIED_TTL = 30.0
REVIEW_TIMEOUT = 10.0
CACHE_LIMIT = 1024

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
_REASONS = {200: "200 OK", 401: "401 Unauthorized", 403: "403 Forbidden", 500: "500 Internal Server Error"}


class MetricsAuth:
    """The decision for one scrape (``check``), and the WSGI middleware applying it (``wrap``)."""

    def __init__(self, api: client.ApiClient, loop: asyncio.AbstractEventLoop) -> None:
        self.api = api
        self.loop = loop
        self._cache: dict[tuple[str, str, str], tuple[int, float]] = {}
        self._lock = threading.Lock()

    def check(self, authorization: str, path: str, verb: str) -> int:
        """200, 401, 403 or 500 for a request with this ``Authorization`` header (metrics thread)."""
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401
        key = (token, path, verb)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            status = asyncio.run_coroutine_threadsafe(self.review(token, path, verb), self.loop).result(
                REVIEW_TIMEOUT
            )
        except Exception as e:
            log.warning("metrics authentication failed", error=f"{type(e).__name__}: {e}")
            return 500
        with self._lock:
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = (status, now + (ALLOWED_TTL if status == 200 else DENIED_TTL))
        return status

    async def review(self, token: str, path: str, verb: str) -> int:
        """TokenReview, then SubjectAccessReview; raises when the API server refuses either."""
        authn: Any = client.AuthenticationV1Api(self.api)
        review = await read_json(
            await authn.create_token_review(
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}},
                _preload_content=False,
            )
        )
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return 401
        user = status.get("user") or {}
        authz: Any = client.AuthorizationV1Api(self.api)
        access = await read_json(
            await authz.create_subject_access_review(
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {
                        "user": user.get("username", ""),
                        "uid": user.get("uid", ""),
                        "groups": user.get("groups") or [],
                        "extra": user.get("extra") or {},
                        "nonResourceAttributes": {"path": path, "verb": verb},
                    },
                },
                _preload_content=False,
            )
        )
        return 200 if (access.get("status") or {}).get("allowed") else 403

    def wrap(self, app: WsgiApp) -> WsgiApp:
        """``app`` behind the check; a refused request gets the status and a one-line reason."""

        def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            status = self.check(
                environ.get("HTTP_AUTHORIZATION", ""),
                environ.get("PATH_INFO", "") or "/",
                str(environ.get("REQUEST_METHOD", "GET")).lower(),
            )
            if status == 200:
                return app(environ, start_response)
            body = _REASONS[status].split(" ", 1)[1].encode() + b"\n"
            start_response(
                _REASONS[status], [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))]
            )
            return [body]

        return guarded
