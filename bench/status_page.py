"""Time the status page at a large pool: ``collect`` + ``render`` of /status (and /status.json's
encoding) over N endpoints with fresh metrics and a full decision ring (median of several runs).

    python bench/status_page.py [--endpoints 1000] [--runs 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epp.config.loader import load_config
from epp.datalayer.store import EndpointStore
from epp.framework.endpoint import EndpointMetadata, Metrics
from epp.scheduling.decision import Decision, Recorded, Row
from epp.server import status_page
from epp.server.app import EppServer, ServeOptions
from epp.server.decisions import DecisionLog


def build(n: int) -> EppServer:
    store = EndpointStore()
    for i in range(n):
        store.upsert(EndpointMetadata(f"pod-{i}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8000))
    now = time.monotonic()
    for i, e in enumerate(store.endpoints()):
        e.metrics = Metrics(
            waiting_queue_size=i % 7,
            running_requests_size=i % 13,
            kv_cache_usage_percent=(i % 100) / 100,
            update_time=now,
            fresh_until=now + 3600,
        )
        e.inflight = i % 5
    server = EppServer(load_config(None), ServeOptions(pool_name="bench"), store)
    ring = server.director.decisions = DecisionLog(100, 0.0)
    eps = list(store.endpoints())
    scorers = (("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0), ("prefix-cache-scorer", 3.0))
    for k in range(100):
        rows = tuple(
            Row(e.metadata.name, e.hostport, j == 0, 4.0 - j, (2.0, 2.0 - j, 0.0))
            for j, e in enumerate(eps[k : k + 3])
        )
        ring.record(f"req-{k}", "demo", [Recorded.built(Decision("default", n, scorers, rows))])
    for e in eps:
        server.director.activity.request(e.hostport)
    return server


def main() -> int:
    from epp import logs

    logs.configure("warning", "console")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    server = build(args.endpoints)
    html_ms, html_cpu, json_ms = [], [], []
    size = 0
    for _ in range(args.runs):
        t0, c0 = time.perf_counter(), time.process_time()
        page = status_page.render(status_page.collect(server))
        html_ms.append((time.perf_counter() - t0) * 1000)
        html_cpu.append((time.process_time() - c0) * 1000)
        t0 = time.perf_counter()
        json.dumps(status_page.collect(server))
        json_ms.append((time.perf_counter() - t0) * 1000)
        size = len(page)
    # CPU time is the render's own cost; wall time also counts waiting for a busy machine's cores.
    print(
        f"status page at {args.endpoints} endpoints: /status {statistics.median(html_cpu):.1f} ms CPU "
        f"({statistics.median(html_ms):.1f} ms wall, max {max(html_ms):.1f}), "
        f"/status.json {statistics.median(json_ms):.1f} ms wall, page {size / 1024:.0f} KiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
