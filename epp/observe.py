"""``epp explain URL`` and ``epp status URL``: the metrics port's ``/debug/decisions`` and
``/status.json`` printed as terminal tables (URL: the EPP's metrics address, e.g. localhost:9090).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def add_commands(sub: Any) -> None:
    p = sub.add_parser("explain", help="print the last scheduling decisions of a running EPP")
    p.add_argument("url", help="the EPP's metrics port, e.g. http://localhost:9090")
    p.add_argument("--limit", type=int, default=20, help="decisions shown, newest first (default 20)")
    p.add_argument("--request-id", default="", help="only the decision of this request id")
    p.add_argument("--json", action="store_true", help="print the JSON as served")
    p.set_defaults(func=explain)
    p = sub.add_parser("status", help="print the status page of a running EPP as a table")
    p.add_argument("url", help="the EPP's metrics port, e.g. http://localhost:9090")
    p.add_argument("--json", action="store_true", help="print the JSON as served")
    p.set_defaults(func=status)


def _get(base: str, path: str) -> Any:
    if "://" not in base:
        base = f"http://{base}"
    url = base.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"error: {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SystemExit(f"error: {url}: {e}") from None


def _table(rows: list[list[str]], out: Any) -> None:
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


def explain(args: argparse.Namespace) -> int:
    limit = 1000 if args.request_id else max(args.limit, 0)
    data = _get(args.url, f"/debug/decisions?limit={limit}")
    decisions = data.get("decisions", [])
    if args.request_id:
        decisions = [d for d in decisions if d.get("request_id") == args.request_id]
    if args.json:
        print(json.dumps(decisions, indent=2))
        return 0
    out = sys.stdout
    if not data.get("enabled"):
        print("this EPP keeps no decisions (--decision-ring-size=0)", file=out)
        return 0
    if not decisions:
        print("no decisions" + (f" for request id {args.request_id}" if args.request_id else ""), file=out)
        return 1 if args.request_id else 0
    for d in decisions:
        when = time.strftime("%H:%M:%S", time.localtime(d.get("time", 0)))
        print(f"{when}  request {d.get('request_id', '')}  model {d.get('model', '')}", file=out)
        for prof in d.get("profiles", []):
            weights = prof.get("weights", {})
            names = list(weights)
            print(f"  profile {prof.get('profile', '')} ({prof.get('candidates', 0)} candidates)", file=out)
            head = ["", "endpoint", "total", *(f"{n}*{weights[n]:g}" for n in names)]
            rows = [head]
            for e in prof.get("endpoints", []):
                scores = e.get("scores", {})
                rows.append(
                    [
                        "*" if e.get("picked") else "",
                        f"{e.get('address', '')} ({e.get('name', '')})",
                        f"{e.get('total', 0):.3f}",
                        *(f"{scores.get(n, 0):.3f}" for n in names),
                    ]
                )
            _table([["  " + r[0], *r[1:]] for r in rows], out)
        print(file=out)
    return 0


def status(args: argparse.Namespace) -> int:
    data = _get(args.url, "/status.json")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    out = sys.stdout
    for line in summary_lines(data):
        print(line, file=out)
    for pool in data.get("pools", []):
        print(f"\npool {pool.get('name', '')}: {len(pool.get('endpoints', []))} endpoints", file=out)
        rows = [[c for c, _ in ENDPOINT_COLUMNS]]
        rows += [[cell(e, key) for _, key in ENDPOINT_COLUMNS] for e in pool.get("endpoints", [])]
        _table(rows, out)
    return 0


# (heading, key) of the endpoint table: the HTML page and the terminal show the same columns
ENDPOINT_COLUMNS = (
    ("endpoint", "name"),
    ("address", "address"),
    ("state", "state"),
    ("metrics age", "metrics_age_s"),
    ("queue", "queue"),
    ("running", "running"),
    ("kv usage", "kv_usage"),
    ("in flight", "inflight"),
    ("req/min", "requests_1m"),
    ("err/min", "errors_1m"),
)


def cell(endpoint: dict[str, Any], key: str) -> str:
    """One endpoint-table cell as text (the same in the terminal and on the page)."""
    value = endpoint.get(key)
    if value is None:
        return "-"
    if key == "metrics_age_s":
        return f"{value:.1f}s"
    if key == "kv_usage":
        return f"{100 * value:.0f}%"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The status page's header facts, one per line."""
    cfg = data.get("config", {})
    lines = [
        f"epp {data.get('version', '')}  serving: {'yes' if data.get('serving') else 'no'}"
        + (f" ({'; '.join(data.get('not_ready', []))})" if data.get("not_ready") else ""),
        f"config: version {cfg.get('version', '')}, reload {cfg.get('reload', '')}",
    ]
    prefix = data.get("prefix_index")
    if prefix:
        lines.append("prefix index: " + ", ".join(f"{k} {v:g}" for k, v in prefix.items()))
    flow = data.get("flow_control")
    if flow is not None:
        lines.append(f"flow control: {flow.get('queued', 0):g} queued" + _detail(flow.get("queues", {})))
    peers = data.get("peers")
    if peers is not None:
        lines.append(
            f"cross-replica: {peers.get('count', 0)} peers, lag {peers.get('lag_s', '-')}s"
            + (f", last error: {peers['error']}" if peers.get("error") else "")
        )
    return lines


def _detail(values: dict[str, Any]) -> str:
    return (" (" + ", ".join(f"{k}: {v}" for k, v in values.items()) + ")") if values else ""
