"""The status page: its data is the EPP's own state, everything shown is escaped, the page carries
the headers of a read-only page, refreshes itself and holds no prompt text."""

from __future__ import annotations

import json
import time
from typing import Any

from epp.config.loader import load_config
from epp.datalayer.store import EndpointStore
from epp.framework.endpoint import EndpointMetadata, Metrics
from epp.scheduling.decision import Decision, Recorded, Row
from epp.server import status_page
from epp.server.activity import WINDOW, EndpointActivity
from epp.server.app import EppServer, ServeOptions
from epp.server.decisions import DecisionLog
from epp.server.metrics_port import MetricsPort

EVIL = "<script>alert('x')</script>"


def _server() -> EppServer:
    store = EndpointStore()
    store.upsert(EndpointMetadata("ok-pod", "10.0.0.1", 8000))
    store.upsert(EndpointMetadata(EVIL, "10.0.0.2", 8000))
    store.upsert(EndpointMetadata("new-pod", "10.0.0.3", 8000))
    now = time.monotonic()
    eps = {e.metadata.name: e for e in store.endpoints()}
    eps["ok-pod"].metrics = Metrics(
        waiting_queue_size=3,
        running_requests_size=5,
        kv_cache_usage_percent=0.25,
        update_time=now - 0.5,
        fresh_until=now + 60,
    )
    eps[EVIL].metrics = Metrics(waiting_queue_size=1, update_time=now - 30, fresh_until=now - 28)
    eps["ok-pod"].inflight = 2
    server = EppServer(load_config(None), ServeOptions(pool_name="demo-pool"), store)
    server.director.activity.request("10.0.0.1:8000")
    server.director.activity.request("10.0.0.1:8000")
    server.director.activity.error("10.0.0.1:8000")
    ring = server.director.decisions = DecisionLog(10, 0.0)
    rows = (Row(EVIL, "10.0.0.2:8000", True, 2.0, (2.0,)),)
    ring.record("rid-<b>", "demo", [Recorded.built(Decision("default", 3, (("queue-scorer", 2.0),), rows))])
    return server


def test_the_data_is_the_epps_state() -> None:
    data = status_page.collect(_server())
    (pool,) = data["pools"]
    assert pool["name"] == "default/demo-pool"
    by_name = {e["name"]: e for e in pool["endpoints"]}
    ok = by_name["ok-pod"]
    assert ok["state"] == "ready" and ok["queue"] == 3 and ok["running"] == 5 and ok["kv_usage"] == 0.25
    assert ok["inflight"] == 2 and ok["requests_1m"] == 2 and ok["errors_1m"] == 1
    assert 0.4 < ok["metrics_age_s"] < 5
    assert by_name[EVIL]["state"] == "stale (stale)"
    assert by_name["new-pod"]["state"] == "stale (never)" and by_name["new-pod"]["queue"] is None
    assert data["decisions"][0]["request_id"] == "rid-<b>"
    assert len(data["config"]["version"]) == 12 and data["config"]["reload"] == "not watched"
    assert data["flow_control"] is None and data["peers"] is None
    json.dumps(data)


def test_the_page_escapes_everything_and_refreshes_itself() -> None:
    page = status_page.render(status_page.collect(_server()))
    assert EVIL not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "rid-<b>" not in page and "rid-&lt;b&gt;" in page
    assert "<meta http-equiv='refresh'" in page
    assert "<script" not in page  # nothing runs on it


def _get(app: Any, path: str) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET"}, start_response))
    return seen["status"], seen["headers"], body


def test_the_page_is_served_read_only() -> None:
    server = _server()
    app = MetricsPort(server.health, lambda: server.director.decisions, lambda: status_page.collect(server))
    wrapped = app.wrap(lambda environ, start_response: [b""])
    for path, ctype in (("/status", "text/html; charset=utf-8"), ("/status.json", "application/json")):
        status, headers, _body = _get(wrapped, path)
        assert status == "200 OK" and headers["Content-Type"] == ctype
        csp = headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
        assert headers["X-Frame-Options"] == "DENY"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-store"
    data = json.loads(_get(wrapped, "/status.json")[2])
    assert {e["name"] for e in data["pools"][0]["endpoints"]} == {"ok-pod", EVIL, "new-pod"}


def test_activity_counts_the_last_minute_only() -> None:
    now = [1000.0]
    activity = EndpointActivity(clock=lambda: now[0])
    activity.request("a")
    now[0] += WINDOW - 1
    activity.request("a")
    activity.error("a")
    assert activity.last_minute("a") == (2, 1)
    now[0] += 1  # the first second left the window
    assert activity.last_minute("a") == (1, 1)
    now[0] += WINDOW
    assert activity.last_minute("a") == (0, 0)
    assert activity.last_minute("b") == (0, 0)
