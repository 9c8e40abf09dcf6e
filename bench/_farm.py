"""An endpoint farm: many fake vLLM engines served by one process (``bench/scale.py``).

Every port of ``--base-port .. --base-port + --count - 1`` on ``--host`` answers ``GET /metrics``
with a vLLM-style exposition (the families and label sets of vLLM's v1 Prometheus logger: gauges,
counters with ``_total``/``_created``, histograms with their buckets; about 50 KB), whose queue,
running and KV-cache values differ per endpoint and drift every second, and ``POST
/v1/chat/completions`` / ``/v1/completions`` with a small fixed answer. A raw asyncio protocol
(keep-alive HTTP/1.1, no framework) keeps the farm's own CPU per request low. ``GET /stats`` on
``--control-port`` returns the scrapes served (total, per-endpoint max and min) and the p50/p99
interval between two scrapes of one endpoint; ``POST /reset`` starts a new window. With
``--push-base-port P`` endpoint ``i`` also publishes SGLang's ``LoadStat`` (the same running,
waiting and KV values) on a ZMQ PUB socket at ``P + i`` every ``--push-interval`` seconds (spread
over the interval), as ``zmq-metrics-data-source`` reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MODEL = "demo"
_LABELS = ["model_name", "engine"]
_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)
_COUNTERS = (
    "vllm:corrupted_requests",
    "vllm:external_prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:generation_tokens",
    "vllm:mm_cache_hits",
    "vllm:mm_cache_queries",
    "vllm:num_preemptions",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_cached",
)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_HISTOGRAMS = {
    "vllm:e2e_request_latency_seconds": _LATENCY,
    "vllm:request_queue_time_seconds": _LATENCY,
    "vllm:request_inference_time_seconds": _LATENCY,
    "vllm:request_prefill_time_seconds": _LATENCY,
    "vllm:request_decode_time_seconds": _LATENCY,
    "vllm:time_to_first_token_seconds": _TTFT,
    "vllm:inter_token_latency_seconds": _ITL,
    "vllm:request_time_per_output_token_seconds": _ITL,
    "vllm:iteration_tokens_total": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "vllm:request_prompt_tokens": _TOKENS,
    "vllm:request_generation_tokens": _TOKENS,
    "vllm:request_max_num_generation_tokens": _TOKENS,
    "vllm:request_params_max_tokens": _TOKENS,
    "vllm:request_prefill_kv_computed_tokens": _TOKENS,
    "vllm:request_params_n": (1, 2, 5, 10, 20),
    "vllm:request_num_preemptions": (0, 1, 2, 5, 10),
    "vllm:kv_block_lifetime_seconds": (0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0),
    "vllm:kv_block_idle_before_evict_seconds": (0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0),
    "vllm:kv_block_reuse_gap_seconds": (0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0),
}


def exposition_parts() -> tuple[list[bytes], list[str]]:
    """The page split around the three per-endpoint gauge values, and the gauges in page order."""
    registry = CollectorRegistry()
    labels = (MODEL, "0")
    for name in _GAUGES:
        Gauge(name, f"{name} (farm)", _LABELS, registry=registry).labels(*labels).set(1)
    for name in _COUNTERS:
        Counter(name, f"{name} (farm)", _LABELS, registry=registry).labels(*labels).inc(1234)
    Counter("vllm:request_success", "finished (farm)", [*_LABELS, "finished_reason"], registry=registry)
    success = registry._names_to_collectors["vllm:request_success"]  # type: ignore[attr-defined]
    for reason in ("stop", "length", "abort", "error", "repetition"):
        success.labels(MODEL, "0", reason).inc(10)
    by_source = Counter("vllm:prompt_tokens_by_source", "by source", [*_LABELS, "source"], registry=registry)
    cached = Counter("vllm:prompt_tokens_cached_by_source", "cached", [*_LABELS, "source"], registry=registry)
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        by_source.labels(MODEL, "0", source).inc(100)
        cached.labels(MODEL, "0", source).inc(50)
    waiting = Gauge(
        "vllm:num_requests_waiting_by_reason", "by reason", [*_LABELS, "reason"], registry=registry
    )
    for reason in ("capacity", "deferred"):
        waiting.labels(MODEL, "0", reason).set(0)
    Gauge("vllm:engine_sleep_state", "sleep", [*_LABELS, "sleep_state"], registry=registry).labels(
        MODEL, "0", "awake"
    ).set(1)
    Gauge(
        "vllm:lora_requests_info",
        "lora",
        ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        registry=registry,
    ).labels("1", "", "").set(time.time())
    Gauge(
        "vllm:cache_config_info",
        "cache config",
        ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization", "num_gpu_blocks"],
        registry=registry,
    ).labels("16", "auto", "True", "0.9", "8192").set(1)
    for name, buckets in _HISTOGRAMS.items():
        h = Histogram(name, f"{name} (farm)", _LABELS, buckets=buckets, registry=registry).labels(*labels)
        for b in buckets[::3]:
            h.observe(b)
    text = generate_latest(registry)
    # split the page around the three gauge values, in the order the page has them
    cuts: list[tuple[int, int, str]] = []
    for name in _GAUGES:
        start = text.index(f"\n{name}{{".encode()) + 1
        line_end = text.index(b"\n", start)
        value_at = text.rindex(b" ", start, line_end) + 1
        cuts.append((value_at, line_end, name))
    cuts.sort()
    parts: list[bytes] = []
    order: list[str] = []
    pos = 0
    for value_at, line_end, name in cuts:
        parts.append(text[pos:value_at])
        order.append(name)
        pos = line_end
    parts.append(text[pos:])
    return parts, order


_COMPLETION = json.dumps(
    {
        "id": "farm",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


class Farm:
    """Counts and interval samples of the scrapes served, per port."""

    def __init__(self, base_port: int, count: int) -> None:
        self.base_port = base_port
        self.count = count
        self.parts, self.order = exposition_parts()
        self.reset()

    def reset(self) -> None:
        self.started = time.monotonic()
        self.scrapes = [0] * self.count
        self.last = [0.0] * self.count
        self.intervals: list[float] = []
        self.requests = 0
        self.pushes = 0

    @staticmethod
    def values(index: int) -> dict[str, float]:
        drift = int(time.monotonic())  # values move every second
        return {
            "vllm:num_requests_waiting": float((index + drift) % 7),
            "vllm:num_requests_running": float((index * 3 + drift) % 13),
            "vllm:kv_cache_usage_perc": ((index + drift) % 10) / 10.0,
        }

    def load_stat(self, index: int) -> bytes:
        v = self.values(index)
        capacity = 131072
        tokens = round(v["vllm:kv_cache_usage_perc"] * capacity)
        running, waiting = int(v["vllm:num_requests_running"]), int(v["vllm:num_requests_waiting"])
        return msgspec.msgpack.encode(["LoadStat", running, waiting, tokens, capacity, None])

    def page(self, index: int) -> bytes:
        values = self.values(index)
        p = self.parts
        out = [p[0]]
        for k, name in enumerate(self.order):
            out += [repr(values[name]).encode(), p[k + 1]]
        return b"".join(out)

    def scraped(self, index: int) -> None:
        now = time.monotonic()
        self.scrapes[index] += 1
        last = self.last[index]
        if last and len(self.intervals) < 2_000_000:
            self.intervals.append(now - last)
        self.last[index] = now

    def stats(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.started
        iv = sorted(self.intervals)

        def q(p: float) -> float:
            return iv[min(len(iv) - 1, int(p * len(iv)))] if iv else 0.0

        return {
            "seconds": elapsed,
            "scrapes": sum(self.scrapes),
            "max_per_endpoint": max(self.scrapes, default=0),
            "min_per_endpoint": min(self.scrapes, default=0),
            "interval_p50": q(0.50),
            "interval_p99": q(0.99),
            "requests": self.requests,
            "pushes": self.pushes,
        }


class _Http(asyncio.Protocol):
    """Keep-alive HTTP/1.1 for one connection to one farm port."""

    def __init__(self, farm: Farm, index: int) -> None:
        self.farm = farm
        self.index = index
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            method, path, _ = [*head.split("\r\n", 1)[0].split(" "), "", ""][:3]
            self.respond(method, path.split("?", 1)[0])

    def respond(self, method: str, path: str) -> None:
        assert self.transport is not None
        if method == "GET" and path == "/metrics":
            self.farm.scraped(self.index)
            body, ctype = self.farm.page(self.index), b"text/plain; version=0.0.4; charset=utf-8"
            status = b"200 OK"
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            self.farm.requests += 1
            body, ctype, status = _COMPLETION, b"application/json", b"200 OK"
        elif path == "/health":
            body, ctype, status = b"ok", b"text/plain", b"200 OK"
        else:
            body, ctype, status = b"not found", b"text/plain", b"404 Not Found"
        self.transport.write(
            b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, ctype, len(body))
            + body
        )


class _Control(asyncio.Protocol):
    def __init__(self, farm: Farm) -> None:
        self.farm = farm
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" not in self.buf:
            return
        assert self.transport is not None
        first = self.buf.split(b"\r\n", 1)[0].decode()
        if first.startswith("POST /reset"):
            self.farm.reset()
        body = json.dumps(self.farm.stats()).encode()
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        self.transport.close()


async def publish(farm: Farm, host: str, base_port: int, interval: float) -> None:
    """Every endpoint's ``LoadStat`` every ``interval`` seconds, the sends spread over it."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    socks = []
    for i in range(farm.count):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.bind(f"tcp://{host}:{base_port + i}")
        socks.append(sock)
    step = max(1, farm.count // max(1, int(interval / 0.01)))  # a batch every ~10 ms
    while True:
        start = time.monotonic()
        for lo in range(0, farm.count, step):
            for i in range(lo, min(farm.count, lo + step)):
                with contextlib.suppress(zmq.Again):
                    socks[i].send(farm.load_stat(i), zmq.NOBLOCK)
                    farm.pushes += 1
            delay = start + interval * (lo + step) / farm.count - time.monotonic()
            await asyncio.sleep(max(0.0, delay))


async def serve(
    host: str, base_port: int, count: int, control_port: int, push_base: int = 0, push_interval: float = 1.0
) -> None:
    farm = Farm(base_port, count)
    loop = asyncio.get_running_loop()
    tasks = []  # kept referenced while the farm serves
    if push_base:
        tasks.append(loop.create_task(publish(farm, host, push_base, push_interval)))
    for i in range(count):
        await loop.create_server(
            lambda i=i: _Http(farm, i), host, base_port + i, backlog=64, reuse_address=True
        )
    await loop.create_server(lambda: _Control(farm), "127.0.0.1", control_port, reuse_address=True)
    print(f"farm: {count} endpoints on {host}:{base_port}..{base_port + count - 1}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--base-port", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--control-port", type=int, required=True)
    ap.add_argument("--push-base-port", type=int, default=0, help="publish LoadStat from this port on")
    ap.add_argument("--push-interval", type=float, default=1.0)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    asyncio.run(
        serve(
            args.host, args.base_port, args.count, args.control_port, args.push_base_port, args.push_interval
        )
    )


if __name__ == "__main__":
    main()
