"""Data sources and extractors beyond the core metrics: ``models-data-source``/``-extractor``,
``dcgm-data-source``/``dcgm-extractor``, the notification sources, per-source ``port`` and
``interval``, and the source/extractor pairing checks, against real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from epp.config.loader import load_document
from epp.datalayer.notifications import EndpointEvents
from epp.datalayer.runtime import DataLayer, effective_intervals
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.framework import ConfigError, DataProducer, Endpoint, EndpointMetadata, Extractor, registry
from epp.framework.endpoint_attributes import GPU_UTILIZATION_KEY, MODELS_KEY, ModelData, scalar_metric_key
from epp.framework.interfaces import EndpointEvent, EventType, Stability
from epp.framework.params import decode_params
from epp.plugins.scraping.core_metrics_extractor import CoreMetricsExtractor, CoreMetricsExtractorParams
from epp.plugins.scraping.dcgm_data_source import DcgmDataSource, DcgmDataSourceParams
from epp.plugins.scraping.dcgm_extractor import DcgmExtractor
from epp.plugins.scraping.endpoint_notification_source import EndpointNotificationSource
from epp.plugins.scraping.metrics_data_source import HttpError, MetricsDataSource, MetricsDataSourceParams
from epp.plugins.scraping.models_data_extractor import ModelsDataExtractor
from epp.plugins.scraping.models_data_source import ModelsDataSource, ModelsDataSourceParams
from epp.server.tls import Authority
from tests.unit.polling import until

INTERVAL = 0.02

MODELS_BODY = (
    b'{"object":"list","data":[{"id":"llama","object":"model","created":1700000000,"owned_by":"vllm",'
    b'"root":"llama","parent":null},{"id":"sql-lora","object":"model","owned_by":"vllm","parent":"llama"}]}'
)


def dcgm_page(*samples: tuple[str | None, float]) -> bytes:
    """A DCGM exporter page: one ``DCGM_FI_DEV_GPU_UTIL`` sample per (pod label or None, percent)."""
    lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for gpu, (pod, value) in enumerate(samples):
        pod_label = f',pod="{pod}",namespace="default"' if pod is not None else ""
        lines.append(f'DCGM_FI_DEV_GPU_UTIL{{gpu="{gpu}",UUID="GPU-{gpu}"{pod_label}}} {value}')
    lines.append('DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-0"} 1024')
    return ("\n".join(lines) + "\n").encode()


class PageServer:
    """A real aiohttp server on 127.0.0.1 answering GETs from a mutable ``pages`` map."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[int, bytes]] = {}
        self.hits: dict[str, int] = {}
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", ssl_context: ssl.SSLContext | None = None) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0, ssl_context=ssl_context)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        status, body = self.pages.get(request.path, (404, b"not found"))
        return web.Response(status=status, body=body)


@pytest.fixture
async def server() -> AsyncIterator[PageServer]:
    s = PageServer()
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def second_server() -> AsyncIterator[PageServer]:
    s = PageServer()
    await s.start()
    yield s
    await s.stop()


def meta(port: int, *, name: str = "pod-a-rank-0", pod: str = "pod-a", node: str = "") -> EndpointMetadata:
    return EndpointMetadata(name, "127.0.0.1", port, pod_name=pod, node_address=node)


async def scrape(store: EndpointStore, scraper: MetricsScraper, condition: Any) -> None:
    scraper.start()
    try:
        await until(condition, timeout=10)
    finally:
        await scraper.stop()


# --- models -------------------------------------------------------------------------------------


async def test_models_source_and_extractor_store_the_served_models(server: PageServer) -> None:
    server.pages["/v1/models"] = (200, MODELS_BODY)
    store = EndpointStore()
    store.upsert(meta(server.port))
    (ep,) = store.endpoints()
    source = ModelsDataSource("models-data-source", ModelsDataSourceParams())
    scraper = MetricsScraper(
        store, source, [ModelsDataExtractor("models-data-extractor", None)], interval=INTERVAL
    )
    await scrape(store, scraper, lambda: MODELS_KEY in ep.attributes)
    assert ep.attributes[MODELS_KEY] == (
        ModelData("llama", "model", 1700000000, "vllm", ""),
        ModelData("sql-lora", "model", 0, "vllm", "llama"),
    )
    assert MODELS_KEY == "/v1/models/models-data-extractor"
    assert ep.metrics.update_time == 0.0  # a models source leaves the engine metrics alone


async def test_models_source_rejects_a_malformed_answer(server: PageServer) -> None:
    server.pages["/v1/models"] = (200, b'{"data": [{"id": 7}]}')
    store = EndpointStore()
    store.upsert(meta(server.port))
    (ep,) = store.endpoints()
    source = ModelsDataSource("m", ModelsDataSourceParams())
    poller = source.poller(ep)
    with pytest.raises(Exception, match=r"data\[0\]\.id"):
        await poller.poll()
    server.pages["/v1/models"] = (200, b"<html>")
    with pytest.raises(Exception, match="invalid JSON"):
        await poller.poll()
    poller.close()


async def test_models_source_custom_path(server: PageServer) -> None:
    server.pages["/api/models"] = (200, b'{"object":"list","data":[{"id":"x"}]}')
    store = EndpointStore()
    store.upsert(meta(server.port))
    (ep,) = store.endpoints()
    source = ModelsDataSource("m", decode_params(ModelsDataSourceParams, {"path": "/api/models"}, "p"))
    scraper = MetricsScraper(store, source, [ModelsDataExtractor("x", None)], interval=INTERVAL)
    await scrape(store, scraper, lambda: MODELS_KEY in ep.attributes)
    assert ep.attributes[MODELS_KEY] == (ModelData("x"),)


# --- DCGM ---------------------------------------------------------------------------------------


def test_dcgm_types_are_alpha_with_reference_defaults() -> None:
    assert DcgmDataSource.stability is Stability.ALPHA
    assert DcgmExtractor.stability is Stability.ALPHA
    p = DcgmDataSourceParams()
    assert (p.scheme, p.path, p.port, p.insecure_skip_verify, p.use_node_address) == (
        "http",
        "/metrics",
        9400,
        True,
        False,
    )


async def test_dcgm_scrapes_its_own_port_and_keeps_this_pods_busiest_gpu(
    server: PageServer, second_server: PageServer
) -> None:
    # the serving port (server) answers no DCGM page; the exporter (second_server) is on another port
    second_server.pages["/metrics"] = (200, dcgm_page(("pod-a", 35.0), ("pod-b", 99.0), ("pod-a", 80.0)))
    store = EndpointStore()
    store.upsert(meta(server.port))
    (ep,) = store.endpoints()
    source = DcgmDataSource("dcgm", decode_params(DcgmDataSourceParams, {"port": second_server.port}, "p"))
    assert source.url(ep) == f"http://127.0.0.1:{second_server.port}/metrics"
    scraper = MetricsScraper(store, source, [DcgmExtractor("dcgm-extractor", None)], interval=INTERVAL)
    await scrape(store, scraper, lambda: GPU_UTILIZATION_KEY in ep.attributes)
    assert ep.attributes[GPU_UTILIZATION_KEY] == pytest.approx(0.80)  # pod-b's 99 % is not ours
    assert GPU_UTILIZATION_KEY == "GPUUtilization/dcgm-extractor"
    assert server.hits == {}


def _extract(page: bytes, ep: Endpoint) -> tuple[str, ...]:
    return DcgmExtractor("d", None).extract_attributes(ep, page)


def test_dcgm_extractor_sidecar_pages_and_errors() -> None:
    ep = Endpoint(meta(1))
    assert _extract(dcgm_page((None, 20.0), (None, 60.0)), ep) == ()  # sidecar: no pod label, all ours
    assert ep.attributes[GPU_UTILIZATION_KEY] == pytest.approx(0.6)
    errors = _extract(dcgm_page(("pod-z", 50.0)), ep)
    assert errors and "no samples for pod 'pod-a'" in errors[0]
    assert ep.attributes[GPU_UTILIZATION_KEY] == pytest.approx(0.6)  # unchanged on error
    errors = _extract(b'DCGM_FI_DEV_FB_USED{gpu="0"} 1\n', ep)
    assert errors and "not found" in errors[0]


async def test_dcgm_use_node_address_targets_the_node(second_server: PageServer) -> None:
    second_server.pages["/metrics"] = (200, dcgm_page(("pod-a", 42.0)))
    store = EndpointStore()
    # the pod address is unroutable here; the node address is where the DaemonSet exporter listens
    store.upsert(
        EndpointMetadata("pod-a-rank-0", "192.0.2.1", 8000, pod_name="pod-a", node_address="127.0.0.1")
    )
    (ep,) = store.endpoints()
    params = decode_params(DcgmDataSourceParams, {"port": second_server.port, "useNodeAddress": True}, "p")
    source = DcgmDataSource("dcgm", params)
    scraper = MetricsScraper(store, source, [DcgmExtractor("d", None)], interval=INTERVAL)
    await scrape(store, scraper, lambda: GPU_UTILIZATION_KEY in ep.attributes)
    assert ep.attributes[GPU_UTILIZATION_KEY] == pytest.approx(0.42)


# --- metrics-data-source port and interval ------------------------------------------------------


VLLM = (
    b'vllm:num_requests_waiting{model_name="m"} 4\nvllm:num_requests_running{model_name="m"} 2\n'
    b'vllm:kv_cache_usage_perc{model_name="m"} 0.5\nnv_inference_pending_request_count{model="m"} 6\n'
)


async def test_metrics_source_port_scrapes_another_port(
    server: PageServer, second_server: PageServer
) -> None:
    second_server.pages["/metrics"] = (200, VLLM)
    store = EndpointStore()
    store.upsert(meta(server.port))
    (ep,) = store.endpoints()
    source = MetricsDataSource("m", decode_params(MetricsDataSourceParams, {"port": second_server.port}, "p"))
    extractor = CoreMetricsExtractor("c", CoreMetricsExtractorParams())
    scraper = MetricsScraper(store, source, extractor, interval=INTERVAL)
    await scrape(store, scraper, lambda: ep.metrics.update_time > 0)
    assert ep.metrics.waiting_queue_size == 4
    assert server.hits == {}


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        ({"port": 0}, "port", "invalid port 0: must be between 1 and 65535"),
        ({"port": 70000}, "port", "must be between 1 and 65535"),
        ({"interval": "soon"}, "interval", "invalid interval 'soon'"),
        ({"interval": "-1s"}, "interval", "interval must be non-negative"),
        ({"scheme": "ftp"}, "scheme", "unsupported scheme"),
        (
            {"scheme": "https", "insecureSkipVerify": False, "caCertPath": "/nonexistent/ca.pem"},
            "caCertPath",
            "no such file",
        ),
    ],
)
def test_metrics_source_parameter_errors(params: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        decode_params(MetricsDataSourceParams, params, "parameters")
    assert e.value.field == f"parameters.{field}"
    assert reason in e.value.reason


def test_effective_intervals_round_to_the_base_tick() -> None:
    tick, periods = effective_intervals(0.05, [None, 1.0, 0.12, 0.01])
    assert tick == 0.05  # lowered to the smallest interval, but never below 50 ms
    assert periods == pytest.approx([0.05, 1.0, 0.1, 0.05])
    tick, periods = effective_intervals(0.2, [None, 0.1, 0.25])
    assert tick == pytest.approx(0.1)  # the base tick drops to the smallest source interval
    assert periods == pytest.approx([0.1, 0.1, 0.3])  # 0.25 / 0.1 = 2.5 rounds half up


async def test_a_slower_source_polls_less_often(server: PageServer) -> None:
    server.pages["/metrics"] = (200, VLLM)
    server.pages["/v1/models"] = (200, MODELS_BODY)
    doc = yaml.safe_load(
        """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
- type: core-metrics-extractor
- type: models-data-source
  parameters: {interval: 500ms}
- type: models-data-extractor
dataLayer:
  sources:
  - {pluginRef: metrics-data-source, extractors: [{pluginRef: core-metrics-extractor}]}
  - {pluginRef: models-data-source, extractors: [{pluginRef: models-data-extractor}]}
"""
    )
    cfg = load_document(doc, "test")
    store = EndpointStore()
    store.upsert(EndpointMetadata("e", "127.0.0.1", server.port, metrics_host=f"127.0.0.1:{server.port}"))
    (ep,) = store.endpoints()
    layer = DataLayer(store, cfg.data_sources, refresh_interval=0.05)
    assert [s.interval for s in layer.scrapers] == pytest.approx([0.05, 0.5])
    layer.start()
    try:
        await until(lambda: server.hits.get("/metrics", 0) >= 20, timeout=20)
    finally:
        await layer.stop()
    metrics_polls, models_polls = server.hits.get("/metrics", 0), server.hits.get("/v1/models", 0)
    assert 1 <= models_polls < metrics_polls / 4, server.hits  # 10x fewer by design; loose bound
    assert ep.attributes[MODELS_KEY][1].parent == "llama"
    assert ep.metrics.waiting_queue_size == 4


# --- core-metrics-extractor: Triton and custom metrics ------------------------------------------


def test_triton_engine_mapping() -> None:
    extractor = CoreMetricsExtractor("c", CoreMetricsExtractorParams())
    ep = Endpoint(EndpointMetadata("t", "10.0.0.1", 8000, labels={"llm-d.ai/engine-type": "triton"}))
    page = b'nv_inference_pending_request_count{model="m"} 6\nnv_inference_exec_count{model="m"} 3\n'
    result = extractor.extract(ep, page)
    assert result.metrics is not None
    assert (result.metrics.waiting_queue_size, result.metrics.running_requests_size) == (6, 3)
    assert result.errors == ()  # KV use and cache info are disabled for Triton, not missing


def test_custom_metrics_become_endpoint_attributes() -> None:
    params = decode_params(
        CoreMetricsExtractorParams,
        {
            "engineConfigs": [
                {
                    "name": "vllm",
                    "customMetrics": [
                        {"attributeKey": "custom.queue", "metricSpec": "nv_inference_pending_request_count"},
                        {"attributeKey": "absent", "metricSpec": "nope{a=b}"},
                    ],
                }
            ]
        },
        "parameters",
    )
    extractor = CoreMetricsExtractor("c", params)
    ep = Endpoint(EndpointMetadata("v", "10.0.0.1", 8000))
    result = extractor.extract(ep, VLLM)
    assert result.metrics is not None and result.metrics.waiting_queue_size == 4  # built-in specs kept
    assert ep.attributes[scalar_metric_key("custom.queue")] == 6.0
    assert scalar_metric_key("custom.queue") == "custom.queue/core-metrics-extractor"
    assert scalar_metric_key("absent") not in ep.attributes
    assert any("nope" in e for e in result.errors)


@pytest.mark.parametrize(
    ("custom", "reason"),
    [
        ([{"attributeKey": "", "metricSpec": "a"}], "attributeKey cannot be empty"),
        (
            [{"attributeKey": "k", "metricSpec": "a"}, {"attributeKey": "k", "metricSpec": "b"}],
            "is duplicated",
        ),
        ([{"attributeKey": "k", "metricSpec": ""}], "spec cannot be empty"),
        ([{"attributeKey": "k", "metricSpec": "a{b=~c}"}], "only '=' matchers"),
    ],
)
def test_custom_metric_errors(custom: list[dict[str, str]], reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        decode_params(
            CoreMetricsExtractorParams,
            {"engineConfigs": [{"name": "x", "customMetrics": custom}]},
            "parameters",
        )
    assert reason in e.value.reason


# --- pairing checks at load -------------------------------------------------------------------


def _load(text: str) -> Any:
    return load_document(
        yaml.safe_load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n" + text), "t"
    )


def test_an_extractor_its_source_cannot_feed_is_rejected() -> None:
    with pytest.raises(ConfigError) as e:
        _load(
            "plugins: [{type: metrics-data-source}, {type: models-data-extractor}]\n"
            "dataLayer:\n  sources: [{pluginRef: metrics-data-source, extractors: "
            "[{pluginRef: models-data-extractor}]}]\n"
        )
    assert e.value.field == "dataLayer.sources[0].extractors[0].pluginRef"
    assert "extractor type mismatch" in e.value.reason


def test_dcgm_extractor_may_read_a_metrics_source_page() -> None:
    cfg = _load(
        "plugins: [{type: metrics-data-source, parameters: {port: 9400}}, {type: dcgm-extractor}]\n"
        "dataLayer:\n  sources: [{pluginRef: metrics-data-source,"
        " extractors: [{pluginRef: dcgm-extractor}]}]\n"
    )
    assert [type(e) for e in cfg.data_sources[0][1]] == [DcgmExtractor]


def test_duplicate_extractor_type_on_one_source_is_rejected() -> None:
    with pytest.raises(ConfigError) as e:
        _load(
            "plugins: [{type: models-data-source}, {type: models-data-extractor, name: a},"
            " {type: models-data-extractor, name: b}]\n"
            "dataLayer:\n  sources: [{pluginRef: models-data-source,"
            " extractors: [{pluginRef: a}, {pluginRef: b}]}]\n"
        )
    assert "duplicate extractor type" in e.value.reason
    assert e.value.field == "dataLayer.sources[0].extractors[1].pluginRef"


def test_k8s_notification_source_requires_version_and_kind() -> None:
    with pytest.raises(ConfigError) as e:
        _load("plugins: [{type: k8s-notification-source, parameters: {kind: Pod}}]\n")
    assert "version and kind are required" in e.value.reason


def test_endpoint_notification_source_needs_an_endpoint_extractor() -> None:
    with pytest.raises(ConfigError) as e:
        _load(
            "plugins: [{type: endpoint-notification-source}, {type: models-data-extractor}]\n"
            "dataLayer:\n  sources: [{pluginRef: endpoint-notification-source, extractors: "
            "[{pluginRef: models-data-extractor}]}]\n"
        )
    assert "requires an EndpointExtractor" in e.value.reason


# --- endpoint notifications ---------------------------------------------------------------------


class _RecordingEndpointExtractor(Extractor):
    type_name = "test-endpoint-recorder"
    seen: list[tuple[EventType, str, str]] = []

    def extract_endpoint(self, event: EndpointEvent) -> None:
        md = event.endpoint.metadata
        type(self).seen.append((event.type, md.key, md.labels.get("v", "")))


async def test_endpoint_notification_source_delivers_the_endpoint_lifecycle() -> None:
    _RecordingEndpointExtractor.seen = []
    cfg = _load(
        "plugins: [{type: endpoint-notification-source}, {type: test-endpoint-recorder}]\n"
        "dataLayer:\n  sources: [{pluginRef: endpoint-notification-source, extractors: "
        "[{pluginRef: test-endpoint-recorder}]}]\n"
    )
    assert isinstance(cfg.data_sources[0][0], EndpointNotificationSource)
    store = EndpointStore()
    store.upsert(EndpointMetadata("a", "10.0.0.1", 8000))  # present before the start
    layer = DataLayer(store, cfg.data_sources, refresh_interval=0.05)
    assert [s.source_name for s in layer.scrapers] == ["metrics-data-source"]  # the injected default
    layer.start()
    store.upsert(EndpointMetadata("b", "10.0.0.2", 8000))
    store.upsert(EndpointMetadata("b", "10.0.0.2", 8000, labels={"v": "2"}))  # in-place update
    store.upsert(EndpointMetadata("b", "10.0.0.2", 8000, labels={"v": "2"}))  # no change: no event
    store.delete("default/a")
    await layer.stop()
    store.delete("default/b")  # stopped: no event
    add, delete = EventType.ADD_OR_UPDATE, EventType.DELETE
    assert _RecordingEndpointExtractor.seen == [
        (add, "default/a", ""),
        (add, "default/b", ""),
        (add, "default/b", "2"),
        (delete, "default/a", ""),
    ]


async def test_a_failing_endpoint_extractor_does_not_stop_the_others() -> None:
    class Boom(Extractor):
        type_name = "boom"

        def extract_endpoint(self, event: EndpointEvent) -> None:
            raise RuntimeError("boom")

    _RecordingEndpointExtractor.seen = []
    store = EndpointStore()
    source = EndpointNotificationSource("s", None)
    events = EndpointEvents(store, source, [Boom("b", None), _RecordingEndpointExtractor("r", None)])
    events.start()
    store.upsert(EndpointMetadata("a", "10.0.0.1", 8000))
    await asyncio.sleep(0)
    assert [e[1] for e in _RecordingEndpointExtractor.seen] == ["default/a"]


class _ForgetfulProducer(DataProducer):
    """A data producer that drops per-endpoint state on endpoint deletion events."""

    type_name = "test-forgetful-producer"

    def __init__(self, name: str, params: Any = None, handle: Any = None) -> None:
        super().__init__(name, params, handle)
        self.known: set[str] = set()

    async def produce(self, cycle: Any, request: Any, endpoints: list[Endpoint]) -> None:
        return None

    def extract_endpoint(self, event: EndpointEvent) -> None:
        key = event.endpoint.metadata.key
        if event.type is EventType.DELETE:
            self.known.discard(key)
        else:
            self.known.add(key)


async def test_a_data_producer_may_take_endpoint_events() -> None:
    cfg = _load(
        "plugins: [{type: endpoint-notification-source}, {type: test-forgetful-producer}]\n"
        "dataLayer:\n  sources: [{pluginRef: endpoint-notification-source, extractors: "
        "[{pluginRef: test-forgetful-producer}]}]\n"
    )
    producer = cfg.plugins["test-forgetful-producer"]
    assert isinstance(producer, _ForgetfulProducer)
    store = EndpointStore()
    layer = DataLayer(store, cfg.data_sources, refresh_interval=0.05)
    for events in layer.endpoint_events:
        events.start()
    store.upsert(EndpointMetadata("a", "10.0.0.1", 8000))
    store.upsert(EndpointMetadata("b", "10.0.0.2", 8000))
    store.delete("default/a")
    assert producer.known == {"default/b"}
    await layer.stop()


def test_a_plain_producer_is_still_not_an_extractor() -> None:
    with pytest.raises(ConfigError) as e:
        _load(
            "plugins: [{type: metrics-data-source}, {type: test-forgetful-producer}]\n"
            "dataLayer:\n  sources: [{pluginRef: metrics-data-source, extractors: "
            "[{pluginRef: test-forgetful-producer}]}]\n"
        )
    assert "is not a fwkdl.ExtractorBase" in e.value.reason


@pytest.fixture(autouse=True)
def _test_types() -> Iterator[None]:
    """Register this module's test-only types for one test, then restore the registry."""
    registry.registered_types()  # import the built-ins first
    saved = dict(registry._REGISTRY)
    registry.register(_RecordingEndpointExtractor)
    registry.register(_ForgetfulProducer)
    try:
        yield
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)


# --- TLS to scrape targets ----------------------------------------------------------------------


async def _tls_server(tmp_path: Path, ca: Authority, *, require_client: bool) -> tuple[PageServer, Path]:
    pair = ca.issue("metrics", ip_addresses=["127.0.0.1"])
    (tmp_path / "srv.crt").write_bytes(pair.cert)
    (tmp_path / "srv.key").write_bytes(pair.key)
    (tmp_path / "ca.crt").write_bytes(ca.cert)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "srv.crt", tmp_path / "srv.key")
    if require_client:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(tmp_path / "ca.crt")
    server = PageServer()
    await server.start(ssl_context=context)
    server.pages["/metrics"] = (200, VLLM)
    return server, tmp_path / "ca.crt"


async def _poll(params: dict[str, Any], port: int) -> Any:
    source = MetricsDataSource(
        "m", decode_params(MetricsDataSourceParams, {"scheme": "https", **params}, "p")
    )
    poller = source.poller(Endpoint(meta(port)))
    try:
        return await poller.poll()
    finally:
        poller.close()


async def test_https_verifies_with_ca_cert_path(tmp_path: Path) -> None:
    ca = Authority.create("scrape-ca")
    server, ca_file = await _tls_server(tmp_path, ca, require_client=False)
    try:
        assert await _poll({"insecureSkipVerify": False, "caCertPath": str(ca_file)}, server.port) == VLLM
        with pytest.raises(ssl.SSLCertVerificationError):  # the system roots do not know this CA
            await _poll({"insecureSkipVerify": False}, server.port)
        assert await _poll({}, server.port) == VLLM  # insecureSkipVerify defaults to true
    finally:
        await server.stop()


async def test_https_presents_the_client_certificate(tmp_path: Path) -> None:
    ca = Authority.create("scrape-ca")
    server, ca_file = await _tls_server(tmp_path, ca, require_client=True)
    client = ca.issue("epp", server=False, client=True)
    (tmp_path / "cli.crt").write_bytes(client.cert)
    (tmp_path / "cli.key").write_bytes(client.key)
    mtls = {"clientCertPath": str(tmp_path / "cli.crt"), "clientKeyPath": str(tmp_path / "cli.key")}
    verified = {"insecureSkipVerify": False, "caCertPath": str(ca_file)}
    try:
        assert await _poll({**verified, **mtls}, server.port) == VLLM
        with pytest.raises((ssl.SSLError, ConnectionError, HttpError)):  # refused without a client cert
            await _poll(verified, server.port)
    finally:
        await server.stop()


def test_client_cert_without_key_and_bad_files_are_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "cli.crt"
    bad.write_bytes(b"not a certificate")
    with pytest.raises(ConfigError) as e:
        decode_params(MetricsDataSourceParams, {"scheme": "https", "clientCertPath": str(bad)}, "parameters")
    assert e.value.field == "parameters.clientCertPath" and "set together" in e.value.reason
    # plain http reads no TLS settings, and a skipped verification no CA bundle
    decode_params(MetricsDataSourceParams, {"clientCertPath": "/nonexistent"}, "parameters")
    decode_params(MetricsDataSourceParams, {"scheme": "https", "caCertPath": "/nonexistent"}, "parameters")
    params = decode_params(
        MetricsDataSourceParams,
        {
            "scheme": "https",
            "clientCertPath": str(tmp_path / "cli.crt"),
            "clientKeyPath": str(tmp_path / "cli.crt"),
        },
        "parameters",
    )
    with pytest.raises(ConfigError) as e:
        MetricsDataSource("m", params)
    assert e.value.field == "clientCertPath" and "loading client cert" in e.value.reason
