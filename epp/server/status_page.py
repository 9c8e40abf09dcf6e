"""The live status page of the metrics port: ``collect`` reads the EPP's state into plain data
(``/status.json``), ``render`` turns it into a self-refreshing read-only HTML page (``/status``).
Everything shown is escaped; no prompt text, no secrets (addresses, counts, scores, config digest).
"""

from __future__ import annotations

import hashlib
import html
import time
from typing import Any

from epp import __version__
from epp.framework.endpoint import MetricsState
from epp.observe import ENDPOINT_COLUMNS, cell, summary_lines

REFRESH_SECONDS = 2
RECENT_DECISIONS = 10
_digests: dict[int, tuple[object, str]] = {}


def collect(server: Any) -> dict[str, Any]:
    """The status of ``server`` (an ``epp.server.app.EppServer``) as JSON-ready data (called from
    the metrics server's thread)."""
    now = time.monotonic()
    opts = server.opts
    ejected = _ejected(server, now)
    activity = server.director.activity
    endpoints = []
    for e in list(server.store.endpoints()):
        m = e.metrics
        state = m.state(now)
        hostport = e.hostport
        requests, errors = activity.last_minute(hostport)
        if hostport in ejected:
            shown = "ejected"
        elif state is MetricsState.FRESH:
            shown = "ready"
        else:
            shown = f"stale ({state.value})"
        known = m.update_time > 0.0
        endpoints.append(
            {
                "name": e.metadata.name,
                "address": hostport,
                "state": shown,
                "metrics_age_s": round(now - m.update_time, 3) if known else None,
                "queue": m.waiting_queue_size if known else None,
                "running": m.running_requests_size if known else None,
                "kv_usage": round(m.kv_cache_usage_percent, 4) if known else None,
                "inflight": e.inflight,
                "requests_1m": requests,
                "errors_1m": errors,
            }
        )
    health = server.health
    decisions = server.director.decisions
    return {
        "version": __version__,
        "serving": health.serving,
        "not_ready": health.reasons(),
        "degraded": health.degraded(),
        "config": _config(server),
        "pools": [{"name": f"{opts.pool_namespace}/{opts.pool_name}", "endpoints": endpoints}],
        "prefix_index": _gauge_by_plugin("llm_d_epp_prefix_indexer_size"),
        "flow_control": _flow_control() if server.flow_control is not None else None,
        "peers": _peers() if server.cfg.cross_replica is not None else None,
        "decisions": [
            {"time": round(d.time, 3), "request_id": d.request_id, "model": d.model, "summary": d.summary()}
            for d in (decisions.recent(RECENT_DECISIONS) if decisions is not None else [])
        ],
    }


def _ejected(server: Any, now: float) -> set[str]:
    """Addresses an endpoint-health-filter holds ejected now."""
    out: set[str] = set()
    for plugin in list(server.cfg.plugins.values()):
        detector = getattr(plugin, "detector", None)
        for hostport, state in list(getattr(detector, "ejected", {}).items()):
            if getattr(state, "ejected_until", 0.0) > now:
                out.add(hostport)
    return out


def _config(server: Any) -> dict[str, Any]:
    from epp.server.config_reload import LAST_SUCCESS, RELOADS

    document = server.cfg.document
    cached = _digests.get(id(server))
    if cached is None or cached[0] is not document:
        text = repr(document)  # the parsed document (dataclasses): equal configs, equal text
        cached = _digests[id(server)] = (document, hashlib.sha256(text.encode()).hexdigest()[:12])
    reloads = {values[0]: int(child.value) for values, child in RELOADS._items()}
    if server.config_watch is None:
        reload = "not watched"
    elif not reloads:
        reload = f"watching {server.config_watch[0]}: no change yet"
    else:
        last = "applied" if LAST_SUCCESS._items()[0][1].value else "refused or invalid"
        counts = ", ".join(f"{k} {v}" for k, v in sorted(reloads.items()))
        reload = f"last change {last} ({counts})"
    return {"version": cached[1], "reload": reload}


def _family(name: str) -> Any:
    from epp import promlite

    return promlite.family(name)


def _gauge_by_plugin(name: str) -> dict[str, float]:
    fam = _family(name)
    if fam is None:
        return {}
    return {"/".join(values) or name: child.value for values, child in fam._items()}


def _flow_control() -> dict[str, Any]:
    fam = _family("llm_d_epp_flow_control_queue_size")
    queues: dict[str, float] = {}
    if fam is not None:
        for values, child in fam._items():
            labels = dict(zip(fam.labelnames, values, strict=True))
            key = f"priority {labels.get('priority', '')} {labels.get('fairness_id', '')}".strip()
            queues[key] = queues.get(key, 0) + child.value
    return {"queued": sum(queues.values()), "queues": {k: v for k, v in queues.items() if v}}


def _peers() -> dict[str, Any]:
    peers = _family("llm_d_epp_cross_replica_peers")
    lag = _family("llm_d_epp_cross_replica_sync_lag_seconds")
    out: dict[str, Any] = {"count": 0, "lag_s": None}
    if peers is not None:
        out["count"] = int(sum(c.value for _, c in peers._items()))
    if lag is not None:
        total = count = 0.0
        for _, child in lag._items():
            total += child.sum
            count += sum(child.counts)
        out["lag_s"] = round(total / count, 3) if count else None
    return out


_STYLE = (
    "body{font:13px system-ui,sans-serif;margin:1em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0}"
    "th,td{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}"
    "th:first-child,td:first-child,td.l{text-align:left}"
    "td.w{white-space:normal;word-break:break-all;max-width:60em}th{background:#f3f3f3}"
    ".bad{color:#b00}.ok{color:#070}h2{font-size:15px;margin:1em 0 .2em}"
)


def render(data: dict[str, Any]) -> str:
    """The HTML page of ``collect``'s data; it reloads itself every ``REFRESH_SECONDS``."""
    esc = html.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>",
        f"<title>epp status</title><style>{_STYLE}</style></head><body>",
        "<h1>epp status</h1><ul>",
    ]
    serving = bool(data.get("serving"))
    for i, line in enumerate(summary_lines(data)):
        klass = (" class='ok'" if serving else " class='bad'") if i == 0 else ""
        out.append(f"<li{klass}>{esc(line)}</li>")
    out.extend(f"<li class='bad'>degraded: {esc(d)}</li>" for d in data.get("degraded", []))
    out.append("</ul>")
    heads = "".join(f"<th>{esc(h)}</th>" for h, _ in ENDPOINT_COLUMNS)
    for pool in data.get("pools", []):
        eps = pool.get("endpoints", [])
        out.append(f"<h2>pool {esc(str(pool.get('name', '')))}: {len(eps)} endpoints</h2>")
        out.append(f"<table id='endpoints'><thead><tr>{heads}</tr></thead><tbody>")
        for e in eps:
            state = str(e.get("state", ""))
            row = []
            for _, key in ENDPOINT_COLUMNS:
                klass = ""
                if key == "state":
                    klass = " class='l ok'" if state == "ready" else " class='l bad'"
                elif key in ("name", "address"):
                    klass = " class='l'"
                row.append(f"<td{klass}>{esc(cell(e, key))}</td>")
            out.append("<tr>" + "".join(row) + "</tr>")
        out.append("</tbody></table>")
    out.append("<h2>recent decisions</h2><table id='decisions'><thead><tr>")
    out.append("<th>time</th><th>request id</th><th>model</th><th>decision</th></tr></thead><tbody>")
    for d in data.get("decisions", []):
        when = time.strftime("%H:%M:%S", time.gmtime(d.get("time", 0)))
        out.append(
            f"<tr><td>{when}</td><td class='l'>{esc(str(d.get('request_id', '')))}</td>"
            f"<td class='l'>{esc(str(d.get('model', '')))}</td>"
            f"<td class='l w'>{esc(str(d.get('summary', '')))}</td></tr>"
        )
    out.append("</tbody></table></body></html>")
    return "".join(out)
