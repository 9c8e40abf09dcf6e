"""The scrape loop against real local HTTP servers, the metrics data source, and the pool gauges."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from epp import cli
from epp.datalayer.pool_gauges import PoolGauges
from epp.datalayer.runtime import DataLayer
from epp.datalayer.scraper import DEFAULT_TIMEOUT, MetricsScraper, default_timeout, is_stale
from epp.datalayer.store import EndpointStore
from epp.framework import ConfigError, Endpoint, EndpointMetadata, Metrics, MetricsState
from epp.framework.params import decode_params
from epp.plugins.scraping.core_metrics_extractor import CoreMetricsExtractor, CoreMetricsExtractorParams
from epp.plugins.scraping.metrics_data_source import HttpError, MetricsDataSource, MetricsDataSourceParams
from epp.server.tls import self_signed_pem
from tests.unit import factories
from tests.unit.factories import metadata
from tests.unit.polling import until

INTERVAL = 0.02
MODEL = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'


def vllm_page(waiting: int = 3, running: int = 7, kv: float = 0.42, target: int = 60_000) -> bytes:
    """A vLLM-like /metrics page of about ``target`` bytes, mostly histogram buckets."""
    out = [f'python_gc_objects_collected_total{{generation="{g}"}} {g * 1000 + 17}.0' for g in range(3)]
    for name, value in (
        ("num_requests_running", float(running)),
        ("num_requests_waiting", float(waiting)),
        ("kv_cache_usage_perc", kv),
    ):
        out += [f"# HELP vllm:{name} {name}.", f"# TYPE vllm:{name} gauge", f"vllm:{name}{{{MODEL}}} {value}"]
    buckets = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, "+Inf"]
    i = 0
    while sum(len(line) + 1 for line in out) < target:
        name = f"vllm:histogram_{i}_seconds"
        i += 1
        out += [f"# HELP {name} A histogram.", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{{MODEL},le="{le}"}} {j * 37.0}' for j, le in enumerate(buckets)]
        out += [f"{name}_sum{{{MODEL}}} 1234.5", f"{name}_count{{{MODEL}}} {len(buckets) * 37.0}"]
    out.append(
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="31250",swap_space="4"} 1.0'
    )
    return ("\n".join(out) + "\n").encode()


class MetricsServer:
    """A real aiohttp server on 127.0.0.1 serving a mutable metrics page, with probes."""

    def __init__(self) -> None:
        self.page = vllm_page()
        self.status = 200
        self.delay = 0.0
        self.chunked = False
        self.close_connection = False
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.peers: set[tuple[str, int]] = set()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=ssl_context)
        await site.start()
        if not self.port:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer:
            self.peers.add(peer[:2])
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            headers = {"Connection": "close"} if self.close_connection else {}
            if self.chunked:
                response = web.StreamResponse(status=self.status, headers=headers)
                response.enable_chunked_encoding()
                await response.prepare(request)
                for i in range(0, len(self.page), 7000):
                    await response.write(self.page[i : i + 7000])
                await response.write_eof()
                return response
            return web.Response(
                body=self.page, status=self.status, content_type="text/plain", headers=headers
            )
        finally:
            self.in_flight -= 1


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    srv = MetricsServer()
    await srv.start()
    yield srv
    await srv.stop()


def _scraper(store: EndpointStore, *, timeout: float = 1.0, **source_params: object) -> MetricsScraper:
    params = decode_params(MetricsDataSourceParams, dict(source_params), "source")
    source = MetricsDataSource("metrics-data-source", params)
    extractor = CoreMetricsExtractor("core-metrics-extractor", CoreMetricsExtractorParams())
    return MetricsScraper(store, source, extractor, interval=INTERVAL, timeout=timeout)


def _metadata(port: int, name: str = "vllm-0") -> EndpointMetadata:
    return metadata(name, "127.0.0.1", port)


def _poll_errors() -> float:
    value = REGISTRY.get_sample_value(
        "llm_d_inference_scheduler_datalayer_poll_errors_total", {"source_type": "metrics-data-source"}
    )
    return value or 0.0


def _extract_errors() -> float:
    value = REGISTRY.get_sample_value(
        "llm_d_inference_scheduler_datalayer_extract_errors_total",
        {"source_type": "metrics-data-source", "extractor_type": "core-metrics-extractor"},
    )
    return value or 0.0


def _endpoint(store: EndpointStore, key: str = "default/vllm-0") -> Endpoint:
    endpoint = store.get(key)
    assert endpoint is not None
    return endpoint


# --- the scrape loop -------------------------------------------------------------------------


async def test_metrics_land_in_store_endpoints_and_follow_changes(server: MetricsServer) -> None:
    store = EndpointStore()
    store.upsert(_metadata(server.port))  # present before start: picked up by subscribe
    scraper = _scraper(store)
    scraper.start()
    try:
        endpoint = _endpoint(store)
        await until(lambda: endpoint.metrics.update_time > 0)
        m = endpoint.metrics
        assert (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage_percent) == (3, 7, 0.42)
        assert (m.cache_block_size, m.cache_num_blocks) == (16, 31250)
        assert not scraper.is_stale(endpoint, 5.0)

        store.upsert(_metadata(server.port, "vllm-1"))  # added while running
        second = _endpoint(store, "default/vllm-1")
        server.page = vllm_page(waiting=9, running=1, kv=0.05)
        await until(
            lambda: endpoint.metrics.waiting_queue_size == 9 and second.metrics.waiting_queue_size == 9
        )
        assert endpoint.metrics.kv_cache_usage_percent == 0.05
        # the most ever seen running stays (7), the current value follows (1)
        assert (endpoint.metrics.running_requests_size, endpoint.metrics.peak_running) == (1, 7)
        assert second.metrics.peak_running == 1
        assert scraper.scraped_endpoints == {endpoint, second}
        # Keep-alive: one connection per endpoint, reused for every scrape.
        await until(lambda: server.requests >= 10)
        assert len(server.peers) == 2
    finally:
        await scraper.stop()
    assert scraper.scraped_endpoints == frozenset()


async def test_dead_server_counts_poll_errors_and_keeps_metrics_stale(server: MetricsServer) -> None:
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store, timeout=0.5)
    scraper.start()
    try:
        endpoint = _endpoint(store)
        await until(lambda: endpoint.metrics.waiting_queue_size == 3)
        await server.stop()
        errors_before = _poll_errors()
        await until(lambda: _poll_errors() >= errors_before + 3)
        last = endpoint.metrics
        await until(lambda: scraper.is_stale(endpoint, 0.1))
        assert endpoint.metrics is last  # nothing replaced the old snapshot
        assert (last.waiting_queue_size, last.running_requests_size) == (3, 7)

        # The server comes back on the same port: scraping recovers on a new connection.
        server.page = vllm_page(waiting=4)
        await server.start()
        await until(lambda: endpoint.metrics.waiting_queue_size == 4)
        assert not scraper.is_stale(endpoint, 5.0)
    finally:
        await scraper.stop()


async def test_unreachable_endpoint_is_stale_from_the_start() -> None:
    store = EndpointStore()
    store.upsert(_metadata(1))  # nothing listens on port 1
    scraper = _scraper(store, timeout=0.5)
    errors_before = _poll_errors()
    scraper.start()
    try:
        await until(lambda: _poll_errors() >= errors_before + 2)
        endpoint = _endpoint(store)
        assert endpoint.metrics == Metrics(failure="connect")  # no values, the reason recorded
        assert endpoint.metrics.state(time.monotonic()) is MetricsState.DOWN  # refused: no server there
        assert scraper.is_stale(endpoint, 1000.0)  # never extracted = stale at any threshold
    finally:
        await scraper.stop()


async def test_removed_endpoint_stops_being_scraped(server: MetricsServer) -> None:
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store)
    scraper.start()
    try:
        endpoint = _endpoint(store)
        await until(lambda: server.requests >= 3)
        store.delete(endpoint.metadata.key)
        assert scraper.scraped_endpoints == frozenset()  # the task is dropped synchronously
        await until(lambda: server.in_flight == 0)
        await asyncio.sleep(0)  # let the cancelled task run its cleanup
        count = server.requests
        await asyncio.sleep(INTERVAL * 10)
        assert server.requests == count
    finally:
        await scraper.stop()


async def test_slow_server_never_gets_overlapping_scrapes(server: MetricsServer) -> None:
    server.delay = INTERVAL * 3  # every scrape overruns the interval
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store)
    errors_before = _poll_errors()
    scraper.start()
    try:
        await until(lambda: server.requests >= 6)
        assert server.max_in_flight == 1
        assert _poll_errors() == errors_before  # slow but within the timeout: no errors
        assert _endpoint(store).metrics.waiting_queue_size == 3
    finally:
        await scraper.stop()


async def test_poll_timeout_counts_an_error_and_the_next_poll_is_clean(server: MetricsServer) -> None:
    server.delay = 0.5
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store, timeout=0.1)
    errors_before = _poll_errors()
    scraper.start()
    try:
        endpoint = _endpoint(store)
        await until(lambda: _poll_errors() >= errors_before + 2)
        assert endpoint.metrics.update_time == 0.0
        # Polls never overlap: each one timed out (an error) before the next began. (Counted on the
        # client side: a timed-out request may still be running server-side, for as long as the
        # machine's load makes it.)
        assert server.requests <= _poll_errors() - errors_before + 1
        server.delay = 0.0
        await until(lambda: endpoint.metrics.waiting_queue_size == 3)
    finally:
        await scraper.stop()


async def test_non_200_status_is_a_poll_error(server: MetricsServer) -> None:
    server.status = 503
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store)
    errors_before = _poll_errors()
    scraper.start()
    try:
        await until(lambda: _poll_errors() >= errors_before + 2)
        assert _endpoint(store).metrics.update_time == 0.0
        server.status = 200
        await until(lambda: _endpoint(store).metrics.waiting_queue_size == 3)
    finally:
        await scraper.stop()


async def test_chunked_and_connection_close_responses(server: MetricsServer) -> None:
    server.chunked = True
    server.close_connection = True
    server.page = vllm_page(waiting=5)
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store)
    scraper.start()
    try:
        endpoint = _endpoint(store)
        await until(lambda: server.requests >= 4 and endpoint.metrics.waiting_queue_size == 5)
        assert endpoint.metrics.cache_num_blocks == 31250  # the last chunk was reassembled
        assert len(server.peers) >= 3  # "Connection: close" made the client reconnect
    finally:
        await scraper.stop()


async def test_extraction_errors_are_counted_and_partial_metrics_kept(server: MetricsServer) -> None:
    server.page = b"vllm:num_requests_running 2\n"
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store)
    errors_before = _extract_errors()
    scraper.start()
    try:
        endpoint = _endpoint(store)
        await until(lambda: _extract_errors() >= errors_before + 2)
        assert endpoint.metrics.running_requests_size == 2
        assert endpoint.metrics.update_time > 0
    finally:
        await scraper.stop()


async def test_https_with_insecure_skip_verify(tmp_path: Path) -> None:
    server = MetricsServer()
    await server.start(_self_signed_context(tmp_path))
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store, scheme="https")
    verifying_store = EndpointStore()
    verifying_store.upsert(_metadata(server.port))
    verifying = _scraper(verifying_store, scheme="https", insecureSkipVerify=False)
    errors_before = _poll_errors()
    scraper.start()
    verifying.start()
    try:
        await until(lambda: _endpoint(store).metrics.waiting_queue_size == 3)
        await until(lambda: _poll_errors() >= errors_before + 2)  # the verifying client rejects it
        assert _endpoint(verifying_store).metrics.update_time == 0.0
    finally:
        await scraper.stop()
        await verifying.stop()
        await server.stop()


def _self_signed_context(tmp_path: Path) -> ssl.SSLContext:
    key, cert = self_signed_pem("metrics.test")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert)
    key_file.write_bytes(key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


async def test_stop_then_start_again_resumes_scraping(server: MetricsServer) -> None:
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    scraper = _scraper(store)
    scraper.start()
    await until(lambda: server.requests >= 1)
    await scraper.stop()
    store.upsert(_metadata(server.port, "vllm-1"))  # added while stopped: not scraped
    assert scraper.scraped_endpoints == frozenset()
    scraper.start()
    try:
        second = _endpoint(store, "default/vllm-1")
        await until(lambda: second.metrics.waiting_queue_size == 3)
        assert len(scraper.scraped_endpoints) == 2
    finally:
        await scraper.stop()


async def _raw_server(reply: bytes, close_after: bool) -> tuple[asyncio.Server, list[int]]:
    """A raw HTTP server answering every request with ``reply``; counts connections."""
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(reply)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), connections


async def test_poller_retries_once_when_the_server_closed_a_kept_alive_connection() -> None:
    # The server answers as keep-alive, then closes (an idle timeout): the next poll must succeed
    # on a fresh connection instead of failing.
    server, connections = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nm 1\n", True)
    port = server.sockets[0].getsockname()[1]
    poller = MetricsDataSource("m", MetricsDataSourceParams()).poller(Endpoint(_metadata(port)))
    try:
        for _ in range(3):
            assert await poller.poll() == b"m 1\n"
        assert connections[0] == 3
    finally:
        poller.close()
        server.close()
        await server.wait_closed()


async def test_poller_reads_close_delimited_bodies_and_reuses_keep_alive() -> None:
    server, _ = await _raw_server(b"HTTP/1.0 200 OK\r\n\r\nm 2\n", True)
    port = server.sockets[0].getsockname()[1]
    poller = MetricsDataSource("m", MetricsDataSourceParams()).poller(Endpoint(_metadata(port)))
    keep_alive, kept = await _raw_server(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nm 3\n", False)
    kept_poller = MetricsDataSource("m", MetricsDataSourceParams()).poller(
        Endpoint(_metadata(keep_alive.sockets[0].getsockname()[1]))
    )
    try:
        assert [await poller.poll() for _ in range(2)] == [b"m 2\n", b"m 2\n"]
        assert [await kept_poller.poll() for _ in range(3)] == [b"m 3\n"] * 3
        assert kept[0] == 1
    finally:
        poller.close()
        kept_poller.close()
        for srv in (server, keep_alive):
            srv.close()
            await srv.wait_closed()


async def test_poller_rejects_malformed_responses() -> None:
    server, _ = await _raw_server(b"SPDY/9 200 OK\r\n\r\n", True)
    port = server.sockets[0].getsockname()[1]
    poller = MetricsDataSource("m", MetricsDataSourceParams()).poller(Endpoint(_metadata(port)))
    try:
        with pytest.raises(HttpError, match="malformed status line"):
            await poller.poll()
    finally:
        poller.close()
        server.close()
        await server.wait_closed()


def test_scraper_rejects_plugins_it_cannot_drive() -> None:
    extractor = CoreMetricsExtractor("x", CoreMetricsExtractorParams())
    with pytest.raises(TypeError, match="poller"):
        MetricsScraper(EndpointStore(), extractor, extractor)  # type: ignore[arg-type]


def test_metrics_data_source_parameters() -> None:
    params = decode_params(MetricsDataSourceParams, {}, "p")
    assert params == MetricsDataSourceParams(scheme="http", path="/metrics", insecure_skip_verify=True)
    source = MetricsDataSource("m", decode_params(MetricsDataSourceParams, {"path": "/stats"}, "p"))
    endpoint = factories.endpoint("e", metrics_host="10.0.0.2:9090")
    assert source.url(endpoint) == "http://10.0.0.2:9090/stats"
    with pytest.raises(ConfigError) as info:
        decode_params(MetricsDataSourceParams, {"scheme": "ftp"}, "p")
    assert info.value.field == "p.scheme"
    with pytest.raises(ConfigError) as info:
        decode_params(MetricsDataSourceParams, {"path": "metrics"}, "p")
    assert info.value.field == "p.path"


def test_is_stale() -> None:
    endpoint = factories.endpoint("e")
    assert is_stale(endpoint, 1.0, now=100.0)
    endpoint.metrics = Metrics(update_time=99.5)
    assert not is_stale(endpoint, 1.0, now=100.0)
    assert is_stale(endpoint, 0.25, now=100.0)


# --- pool gauges -------------------------------------------------------------------------------


def _gauge(name: str, labels: dict[str, str]) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_pool_gauges_average_fresh_endpoints_only() -> None:
    store = EndpointStore()
    for i, (queue, running, kv, updated) in enumerate(
        [(2, 4, 0.2, 99.0), (4, 8, 0.6, 99.5), (100, 100, 1.0, 50.0)]  # the last one is stale
    ):
        store.upsert(metadata(f"pod-{i}", f"10.0.0.{i + 1}"))
        _endpoint(store, f"default/pod-{i}").metrics = Metrics(
            waiting_queue_size=queue,
            running_requests_size=running,
            kv_cache_usage_percent=kv,
            update_time=updated,
        )
    gauges = PoolGauges(store, "pool-a", staleness=2.0)
    gauges.refresh(now=100.0)
    pool = {"name": "pool-a"}
    assert _gauge("inference_pool_ready_pods", pool) == 2
    assert _gauge("inference_pool_average_queue_size", pool) == 3.0
    assert _gauge("inference_pool_average_running_requests", pool) == 6.0
    assert _gauge("inference_pool_average_kv_cache_utilization", pool) == pytest.approx(0.4)
    per_pod = "inference_pool_per_pod_queue_size"
    assert _gauge(per_pod, {"name": "pool-a", "model_server_pod": "pod-1"}) == 4
    assert _gauge(per_pod, {"name": "pool-a", "model_server_pod": "pod-2"}) is None  # stale

    store.delete("default/pod-1")
    gauges.refresh(now=100.0)
    assert _gauge("inference_pool_ready_pods", pool) == 1
    assert _gauge(per_pod, {"name": "pool-a", "model_server_pod": "pod-1"}) is None  # series removed

    gauges.refresh(now=1000.0)  # everything stale
    assert _gauge("inference_pool_ready_pods", pool) == 0
    assert _gauge("inference_pool_average_queue_size", pool) == 0
    assert _gauge(per_pod, {"name": "pool-a", "model_server_pod": "pod-0"}) is None


async def test_pool_gauges_task_refreshes_periodically() -> None:
    store = EndpointStore()
    store.upsert(metadata("pod-0"))
    gauges = PoolGauges(store, "pool-b", interval=0.01)
    gauges.start()
    try:
        await until(lambda: _gauge("inference_pool_ready_pods", {"name": "pool-b"}) == 0)
        endpoint = _endpoint(store, "default/pod-0")
        endpoint.metrics = Metrics(waiting_queue_size=5, update_time=time.monotonic())
        await until(lambda: _gauge("inference_pool_ready_pods", {"name": "pool-b"}) == 1)
        assert _gauge("inference_pool_average_queue_size", {"name": "pool-b"}) == 5
    finally:
        await gauges.stop()


# --- the scrape timeout ------------------------------------------------------------------------


def test_default_scrape_timeout_follows_the_interval_and_staleness() -> None:
    assert default_timeout(0.05, 2.0) == pytest.approx(1.95)  # the defaults
    assert default_timeout(1.0, 10.0) == 9.0
    assert default_timeout(0.5, 1.0) == 1.0  # at least 1 s
    assert pytest.approx(1.95) == DEFAULT_TIMEOUT


async def test_a_scrape_slower_than_a_second_still_refreshes_with_the_defaults(server: MetricsServer) -> None:
    server.delay = 1.3  # a real vLLM's /metrics under load (measured up to 1.37 s)
    store = EndpointStore()
    store.upsert(_metadata(server.port))
    layer = DataLayer(store, _metrics_source(), refresh_interval=INTERVAL)
    errors_before = _poll_errors()
    layer.start()
    try:
        await until(lambda: _endpoint(store).metrics.waiting_queue_size == 3, timeout=15)
        assert _poll_errors() == errors_before
    finally:
        await layer.stop()


def _metrics_source() -> list[tuple[MetricsDataSource, list[CoreMetricsExtractor]]]:
    params = decode_params(MetricsDataSourceParams, {}, "source")
    source = MetricsDataSource("metrics-data-source", params)
    return [(source, [CoreMetricsExtractor("core-metrics-extractor", CoreMetricsExtractorParams())])]


def test_the_scrape_timeout_flag() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--metrics-scrape-timeout=3s"]).metrics_scrape_timeout == 3.0
    assert parser.parse_args(["serve"]).metrics_scrape_timeout is None
    (scraper,) = DataLayer(
        EndpointStore(), _metrics_source(), refresh_interval=INTERVAL, timeout=3.0
    ).scrapers
    assert scraper.timeout == 3.0


def test_scrapes_start_on_shared_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """With SCRAPE_SLOTS set (off by default), every endpoint's scrapes start on one of that many
    instants per interval, so the data layer's thread wakes for a batch of endpoints at a time."""
    from epp.datalayer import scraper as scraper_module

    monkeypatch.setattr(scraper_module, "SCRAPE_SLOTS", 8)
    SCRAPE_SLOTS = 8
    scraper = _scraper(EndpointStore())
    step = scraper.interval / SCRAPE_SLOTS
    for t in (0.0, 0.001, 12.345, 1000.0 + step / 2):
        slot = scraper._slot(t)
        assert t <= slot < t + step + 1e-9
        assert abs(slot / step - round(slot / step)) < 1e-6
    phases = {round(scraper._phase() / step, 6) for _ in range(400)}
    assert phases == {float(i) for i in range(SCRAPE_SLOTS)}  # every slot used, nothing between
