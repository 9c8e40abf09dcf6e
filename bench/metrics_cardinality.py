"""Metric cardinality under client-chosen model names, and routing latency while /metrics is scraped.

Run: ``.venv/bin/python bench/metrics_cardinality.py --names 5000``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from epp.dev import stack

MODEL = "demo"


def _headers() -> ep.ProcessingRequest:
    hm = HeaderMap(
        headers=[
            HeaderValue(key=":method", raw_value=b"POST"),
            HeaderValue(key=":path", raw_value=b"/v1/completions"),
            HeaderValue(key="content-type", raw_value=b"application/json"),
        ]
    )
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=hm),
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=pm.ProcessingMode.FULL_DUPLEX_STREAMED,
            response_body_mode=pm.ProcessingMode.FULL_DUPLEX_STREAMED,
        ),
    )


_HEADERS = _headers()


async def route(stub: ep_grpc.ExternalProcessorStub, model: str) -> float:
    """One routed request; the seconds until the routing reply arrived."""
    body = json.dumps({"model": model, "prompt": "hello"}).encode()
    t0 = time.perf_counter()
    call = stub.Process()
    await call.write(_HEADERS)
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    await call.read()
    dt = time.perf_counter() - t0
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    return dt


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        data: bytes = r.read()
        return data


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def measure(grpc_port: int, metrics_port: int, pid: int, names: int, samples: int) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = ep_grpc.ExternalProcessorStub(channel)
    for _ in range(20):
        await route(stub, MODEL)
    rss0 = rss_mb(pid)
    t0 = time.perf_counter()
    for i in range(names):
        await route(stub, f"junk-model-{i}")
        if i % 100 == 0:
            await route(stub, MODEL)
    print(f"sent {names} distinct model names in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    page = scrape(metrics_port)
    scrape_s = time.perf_counter() - t0
    series = sum(1 for line in page.splitlines() if line and not line.startswith(b"#"))
    models = {
        line.split(b'model_name="', 1)[1].split(b'"', 1)[0]
        for line in page.splitlines()
        if line.startswith(b"inference_objective_request_total{")
    }
    print(f"/metrics: {len(page) / 1e6:.2f} MB, {series} samples, scrape {scrape_s:.2f}s")
    print(f"distinct model_name on inference_objective_request_total: {len(models)}")
    print(f"RSS: {rss0:.0f} MB before, {rss_mb(pid):.0f} MB after (+{rss_mb(pid) - rss0:.0f} MB)")

    idle = [await route(stub, MODEL) for _ in range(samples)]
    stop = threading.Event()
    scrapes: list[float] = []

    def scraper() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            scrape(metrics_port)
            scrapes.append(time.perf_counter() - t)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    await asyncio.sleep(0.05)
    busy = [await route(stub, MODEL) for _ in range(samples)]
    stop.set()
    thread.join()
    print(f"routing idle:           p50 {_pct(idle, 0.5):.1f} ms  p99 {_pct(idle, 0.99):.1f} ms")
    print(f"routing during scrapes: p50 {_pct(busy, 0.5):.1f} ms  p99 {_pct(busy, 0.99):.1f} ms")
    if scrapes:
        print(f"scrapes during the run: {len(scrapes)}, mean {statistics.mean(scrapes):.2f}s")
    await channel.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", type=int, default=5000, help="distinct model names to send")
    p.add_argument("--samples", type=int, default=300, help="routed requests per latency measurement")
    p.add_argument(
        "--no-served-models",
        action="store_true",
        help="scrape no model names (an engine without model labels): the label cap alone bounds",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, stack.Stack(Path(tmp), log_dir=Path(tmp)) as st:
        sim_port, grpc_port, health_port, metrics_port = (stack.free_port() for _ in range(4))
        sim = st.start_sim("sim-0", sim_port, model=MODEL)
        endpoints = Path(tmp) / "endpoints.yaml"
        stack.write_endpoints(endpoints, [sim_port])
        base = None
        if args.no_served_models:
            base = {
                "plugins": [
                    {"name": "src", "type": "metrics-data-source"},
                    {
                        "name": "ex",
                        "type": "core-metrics-extractor",
                        "parameters": {"engineConfigs": [{"name": "vllm", "runningRequestsSpec": ""}]},
                    },
                ],
                "dataLayer": {"sources": [{"pluginRef": "src", "extractors": [{"pluginRef": "ex"}]}]},
            }
        epp = st.start_epp(
            "epp",
            grpc_port=grpc_port,
            health_port=health_port,
            metrics_port=metrics_port,
            config=stack.epp_config(endpoints, base),
            extra=["--log-level", "warning"],
        )
        st.wait("epp ready", lambda: stack.grpc_serving(health_port), children=[sim, epp])
        time.sleep(1.0)  # a few scrapes of the sim
        asyncio.run(measure(grpc_port, metrics_port, epp.pid, args.names, args.samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
