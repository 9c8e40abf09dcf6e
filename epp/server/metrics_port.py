"""The paths of the metrics port: ``/metrics``, ``/healthz`` (the process runs), ``/readyz`` (what
gRPC health says: 200 serving, 503 not serving), ``/debug/decisions`` (the last decisions, JSON),
``/status`` and ``/status.json`` (the live status page, unless disabled); 404 elsewhere. It runs in
the metrics server's thread and only reads the EPP's state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from epp.server.decisions import DecisionLog
from epp.server.health import Health

WsgiApp = Callable[[dict[str, Any], Any], Iterable[bytes]]

_JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"
# A read-only page: nothing runs, nothing loads, nothing frames it, nobody caches it.
PAGE_HEADERS = (
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'"),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Cache-Control", "no-store"),
    ("Referrer-Policy", "no-referrer"),
)
DECISIONS_LIMIT = 1000  # most entries one /debug/decisions answer carries


class MetricsPort:
    """The metrics port's WSGI router; ``protect`` wraps what needs authentication (all but the
    probes) and ``status`` builds the status page's data (``None``: no status page)."""

    def __init__(
        self,
        health: Health,
        decisions: Callable[[], DecisionLog | None],
        status: Callable[[], dict[str, Any]] | None = None,
        protect: Callable[[WsgiApp], WsgiApp] | None = None,
    ) -> None:
        self.health = health
        self.decisions = decisions
        self.status = status
        self.protect = protect

    def wrap(self, metrics_app: WsgiApp) -> WsgiApp:
        """The router, ``metrics_app`` at ``/metrics`` (a ``promlite.start_http_server`` middleware)."""
        guard = self.protect or (lambda app: app)
        routes: dict[str, WsgiApp] = {
            "/metrics": guard(metrics_app),
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/debug/decisions": guard(self._decisions),
        }
        if self.status is not None:
            routes["/status"] = guard(self._status_html)
            routes["/status.json"] = guard(self._status_json)

        def route(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "") or "/"
            app = routes.get(path.rstrip("/") or "/")
            if app is None:
                return _reply(
                    start_response, "404 Not Found", _TEXT, b"404 not found: the metrics are at /metrics\n"
                )
            if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
                start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
                return [b""]
            return app(environ, start_response)

        return route

    def _healthz(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        return _reply(start_response, "200 OK", _TEXT, b"ok\n")

    def _readyz(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if self.health.serving:
            return _reply(start_response, "200 OK", _TEXT, b"serving\n")
        reasons = "; ".join(self.health.reasons()) or "starting"
        return _reply(start_response, "503 Service Unavailable", _TEXT, f"not serving: {reasons}\n".encode())

    def _decisions(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        raw = (query.get("limit") or ["100"])[0]
        if not raw.isdigit():
            return _reply(start_response, "400 Bad Request", _TEXT, b"limit: a non-negative integer\n")
        log = self.decisions()
        entries = log.recent(min(int(raw), DECISIONS_LIMIT)) if log is not None else []
        body = {
            "enabled": log is not None and log.size > 0,
            "capacity": log.size if log is not None else 0,
            "decisions": [e.to_dict() for e in entries],
        }
        return _reply(start_response, "200 OK", _JSON, json.dumps(body).encode())

    def _status_json(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        assert self.status is not None
        return _reply(start_response, "200 OK", _JSON, json.dumps(self.status()).encode(), PAGE_HEADERS)

    def _status_html(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        from epp.server.status_page import render

        assert self.status is not None
        page = render(self.status()).encode()
        return _reply(start_response, "200 OK", "text/html; charset=utf-8", page, PAGE_HEADERS)


def _reply(
    start_response: Any, status: str, ctype: str, body: bytes, extra: Iterable[tuple[str, str]] = ()
) -> Iterable[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body))), *extra])
    return [body]
