"""``GET /metrics`` of the simulator: the engine's live state with vLLM's metric names and labels,
the faults ``--metrics-fault`` injects, and the DCGM-exporter-like page of ``--dcgm-port``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.dev.sim.context import CONFIG_KEY, ENGINE_KEY, POD_KEY, REGISTRY_KEY, SCRAPES_KEY
from epp.dev.sim.engine import Engine, EngineSnapshot, SimConfig
from epp.dev.sim.latency import Histogram


class EngineCollector(Collector):
    """Renders the engine's real current state with vLLM's metric names and labels."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        config = self._engine.config
        snap = self._engine.snapshot()
        yield from _state_gauges(config, snap)
        yield from _info_gauges(config, snap)
        yield from _counters(config, snap)
        yield from _histograms(config, snap)


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _state_gauges(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    model = config.model
    yield _gauge(
        "vllm:num_requests_running", "Number of requests in model execution batches.", model, snap.running
    )
    yield _gauge(
        "vllm:num_requests_waiting", "Number of requests waiting to be processed.", model, snap.waiting
    )
    yield _gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", model, snap.kv_cache_usage
    )


def _info_gauges(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    cache = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=["block_size", "model_name", "num_gpu_blocks"],
    )
    cache.add_metric([str(config.block_size), config.model, str(config.kv_cache_size)], 1.0)
    yield cache
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "model_name", "running_lora_adapters", "waiting_lora_adapters"],
    )
    running, waiting = ",".join(snap.running_lora_adapters), ",".join(snap.waiting_lora_adapters)
    lora.add_metric([str(config.max_loras), config.model, running, waiting], snap.timestamp)
    yield lora
    if config.lora_modules:
        yield from _lora_residency(config, snap)


def _lora_residency(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    """Where adapters are resident (vLLM's residency gauges), only with LoRA enabled."""
    model = config.model
    loaded = GaugeMetricFamily(
        "vllm:lora_adapter_loaded",
        "1 while the LoRA adapter is resident at this level.",
        labels=["adapter_name", "level", "model_name", "pinned"],
    )
    for level, names in (("gpu", snap.gpu_lora_adapters), ("cpu", snap.cpu_lora_adapters)):
        for name in names:
            loaded.add_metric([name, level, model, "false"], 1.0)
    yield loaded
    yield _gauge(
        "vllm:num_gpu_loaded_lora_adapters",
        "Number of LoRA adapters holding a GPU slot.",
        model,
        len(snap.gpu_lora_adapters),
    )
    yield _gauge(
        "vllm:num_cpu_loaded_lora_adapters",
        "Number of LoRA adapters in the host cache only.",
        model,
        len(snap.cpu_lora_adapters),
    )
    yield _gauge("vllm:max_gpu_lora_adapters", "Number of GPU LoRA adapter slots.", model, config.max_loras)


def _counters(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    model, counters = config.model, snap.counters
    yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", model, counters.prompt_tokens)
    yield _counter(
        "vllm:generation_tokens", "Number of generation tokens processed.", model, counters.generation_tokens
    )
    success = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=["finished_reason", "model_name"],
    )
    for reason, count in counters.request_success.items():
        success.add_metric([reason, model], count)
    yield success
    yield _counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        model,
        counters.prefix_cache_queries,
    )
    yield _counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        model,
        counters.prefix_cache_hits,
    )


def _histogram(name: str, doc: str, model: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], histogram.cumulative(), histogram.total)
    return family


def _histograms(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    model, counters = config.model, snap.counters
    yield _histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        model,
        counters.time_to_first_token,
    )
    yield _histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        model,
        counters.inter_token_latency,
    )
    yield _histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        model,
        counters.request_queue_time,
    )
    if config.lora_modules:
        yield _histogram(
            "vllm:lora_adapter_load_seconds",
            "Histogram of LoRA adapter loads into a GPU slot, in seconds.",
            model,
            counters.lora_adapter_load,
        )


GARBAGE_METRICS = b"<html><body>\x00\xff upstream {{ not [prometheus] text\n</body></html>\n"


async def metrics(request: web.Request) -> web.Response:
    request.app[SCRAPES_KEY][0] += 1
    fault = request.app[CONFIG_KEY].metrics_fault
    if fault == "error":
        return web.Response(status=500, text="metrics exporter failed\n")
    if fault == "hang":
        await asyncio.Event().wait()  # until the client gives up (the handler is then cancelled)
    if fault == "garbage":
        return web.Response(body=GARBAGE_METRICS, headers={"Content-Type": CONTENT_TYPE_LATEST})
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def dcgm_metrics(request: web.Request) -> web.Response:
    """A DCGM exporter's GPU utilisation for this engine's one GPU: ``100 x running / max-num-seqs``."""
    config = request.app[CONFIG_KEY]
    engine = request.app[ENGINE_KEY]
    utilisation = round(100 * engine.snapshot().running / config.max_num_seqs)
    pod = request.app[POD_KEY]
    body = (
        "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n"
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="GPU-sim",device="nvidia0",modelName="sim",'
        f'Hostname="{config.host}",pod="{pod}",namespace="{config.namespace}"}} {utilisation}\n'
    )
    return web.Response(text=body, content_type="text/plain")
