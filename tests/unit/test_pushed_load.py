"""Pushed load: SGLang's LoadStat decoding, and the data layer receiving it from a real ZMQ PUB
socket, with the metrics scrape (a real HTTP server) taking over when the pushes stop."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import yaml
import zmq

from epp.config.loader import load_document
from epp.datalayer.runtime import DataLayer
from epp.datalayer.store import EndpointStore
from epp.dev import stack
from epp.framework import ConfigError
from epp.framework.interfaces import LoadReport
from epp.framework.params import decode_params
from epp.plugins.scraping.core_metrics_extractor import CoreMetricsExtractor, CoreMetricsExtractorParams
from epp.plugins.scraping.metrics_data_source import MetricsDataSource, MetricsDataSourceParams
from epp.plugins.scraping.zmq_metrics_data_source import ZmqMetricsDataSource, ZmqMetricsDataSourceParams
from epp.plugins.scraping.zmq_state_extractor import ZmqStateExtractor, decode_load_stat
from tests.unit.factories import metadata
from tests.unit.polling import until
from tests.unit.test_scraper import MetricsServer, vllm_page


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_load_stat_array_with_rank_and_appended_fields() -> None:
    assert decode_load_stat(_enc(["LoadStat", 3, 5, 1200, 4800, 1, "later"])) == LoadReport(
        3, 5, 1200, 4800, 1
    )


def test_load_stat_without_rank_or_with_null_rank() -> None:
    assert decode_load_stat(_enc(["LoadStat", 0, 0, 0, 100])) == LoadReport(0, 0, 0, 100, None)
    assert decode_load_stat(_enc(["LoadStat", 2, 1, 10, 100, None])) == LoadReport(2, 1, 10, 100, None)


def test_load_stat_map_form() -> None:
    payload = _enc(
        {
            "num_running_reqs": 4,
            "num_waiting_reqs": 0,
            "num_tokens": 7,
            "max_total_num_tokens": 70,
            "dp_rank": 2,
        }
    )
    assert decode_load_stat(payload) == LoadReport(4, 0, 7, 70, 2)


def test_other_tags_are_skipped() -> None:
    assert decode_load_stat(_enc(["KVEventBatch", 1, 2])) is None
    assert decode_load_stat(_enc({"type": "Other"})) is None


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b"", "empty"),
        (b"\xc1", "not msgpack"),
        (_enc(["LoadStat", 1, 2, 3]), "fields"),
        (_enc(["LoadStat", -1, 2, 3, 4]), "num_running_reqs"),
        (_enc(["LoadStat", 1, 2.5, 3, 4]), "num_waiting_reqs"),
        (_enc(["LoadStat", 1, 2, True, 4]), "num_tokens"),
        (_enc(["LoadStat", 1, 2, 3, 4, "x"]), "dp_rank"),
        (_enc([1, 2, 3, 4, 5]), "tagged"),
        (_enc(7), "array or map"),
    ],
)
def test_malformed_load_stat_is_a_clear_error(payload: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        decode_load_stat(payload)


def test_source_params_are_checked() -> None:
    with pytest.raises(ConfigError, match="port"):
        decode_params(ZmqMetricsDataSourceParams, {"port": 0}, "source")
    with pytest.raises(ConfigError, match="fallbackAfter"):
        decode_params(ZmqMetricsDataSourceParams, {"fallbackAfter": "soon"}, "source")


class _Publisher:
    def __init__(self, port: int) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")

    def send(self, *fields: Any) -> None:
        self.sock.send(_enc(["LoadStat", *fields]))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class _SteadyPublisher:
    """Publishes the two data-parallel ranks' LoadStat every 20 ms from a thread of its own, as an
    engine does, until stopped (a publisher that dies: its socket closed)."""

    def __init__(self, port: int) -> None:
        self._pub = _Publisher(port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._pub.send(2, 1, 300, 1000, 0)
                self._pub.send(1, 0, 200, 1000, 1)  # a second data-parallel rank: summed
                self._stop.wait(0.02)
        finally:
            self._pub.close()

    def kill(self) -> None:
        self._stop.set()
        self._thread.join()


async def test_pushes_feed_the_metrics_and_a_silent_publisher_falls_back_to_scraping() -> None:
    server = MetricsServer()
    server.page = vllm_page(waiting=9, running=8, kv=0.1)
    await server.start()
    push_port = stack.free_port()
    store = EndpointStore()
    scrape_source = MetricsDataSource(
        "metrics-data-source", decode_params(MetricsDataSourceParams, {}, "source")
    )
    push_source = ZmqMetricsDataSource(
        "zmq", decode_params(ZmqMetricsDataSourceParams, {"port": push_port, "fallbackAfter": "300ms"}, "s")
    )
    layer = DataLayer(
        store,
        [
            (scrape_source, [CoreMetricsExtractor("core", CoreMetricsExtractorParams())]),
            (push_source, [ZmqStateExtractor("zmq-state-extractor", None)]),
        ],
        refresh_interval=0.05,
    )
    store.upsert(metadata("e0", "127.0.0.1", server.port))
    endpoint = store.endpoints()[0]
    layer.start()
    publisher = _SteadyPublisher(push_port)
    try:
        pushed = layer.pushed[0]
        await until(lambda: pushed.pushing(endpoint))  # the SUB connects asynchronously: heard once it has
        await until(lambda: endpoint.metrics.running_requests_size == 3)
        m = endpoint.metrics
        assert (m.running_requests_size, m.waiting_queue_size, m.kv_cache_usage_percent) == (3, 1, 0.25)
        assert m.known(time.monotonic())
        scrapes = layer.metrics_scraper.scrapes if layer.metrics_scraper else -1
        time.sleep(0.3)  # pushing: the metrics scrape is skipped
        assert layer.metrics_scraper is not None and layer.metrics_scraper.scrapes == scrapes
        publisher.kill()  # the publisher dies: the scrape takes over within fallbackAfter + a tick
        waited = await until(lambda: endpoint.metrics.running_requests_size == 8, timeout=5)
        assert waited < 2.0
        assert endpoint.metrics.waiting_queue_size == 9 and endpoint.metrics.known(time.monotonic())
    finally:
        publisher.kill()
        await layer.stop()
        await server.stop()


def _load(text: str) -> Any:
    return load_document(yaml.safe_load("apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n" + text), "t")


def test_a_push_source_needs_the_load_extractor_and_the_load_extractor_a_push_source() -> None:
    with pytest.raises(ConfigError) as e:
        _load(
            "plugins: [{type: zmq-metrics-data-source}, {type: core-metrics-extractor}]\n"
            "dataLayer:\n  sources: [{pluginRef: zmq-metrics-data-source, extractors: "
            "[{pluginRef: core-metrics-extractor}]}]\n"
        )
    assert e.value.field == "dataLayer.sources[0].extractors[0].pluginRef"
    assert "requires a load extractor" in e.value.reason
    with pytest.raises(ConfigError) as e:
        _load(
            "plugins: [{type: metrics-data-source}, {type: zmq-state-extractor}]\n"
            "dataLayer:\n  sources: [{pluginRef: metrics-data-source, extractors: "
            "[{pluginRef: zmq-state-extractor}]}]\n"
        )
    assert "needs a push source" in e.value.reason


def test_a_config_with_both_sources_loads_and_keeps_the_default_scrape() -> None:
    cfg = _load(
        "plugins: [{type: zmq-metrics-data-source, parameters: {port: 5557}}, {type: zmq-state-extractor}]\n"
        "dataLayer:\n  sources: [{pluginRef: zmq-metrics-data-source, extractors: "
        "[{pluginRef: zmq-state-extractor}]}]\n"
    )
    types = sorted(s.type_name for s, _ in cfg.data_sources)
    assert types == ["metrics-data-source", "zmq-metrics-data-source"]  # the scrape to fall back to
