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
    by_reason = GaugeMetricFamily(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
        "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
        "status). Sum of all reasons equals vllm:num_requests_waiting.",
        labels=["model_name", "reason"],
    )
    by_reason.add_metric([model, "capacity"], snap.waiting)  # the simulator defers nothing
    by_reason.add_metric([model, "deferred"], 0)
    yield by_reason


def _info_gauges(config: SimConfig, snap: EngineSnapshot) -> Iterable[Metric]:
    info = _cache_config(config)
    cache = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
    )
    cache.add_metric(list(info.values()), 1.0)
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
    yield _counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        model,
        counters.prompt_tokens_cached,
    )
    yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", model, 0)


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
    yield _histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        model,
        counters.e2e_request_latency,
    )
    yield _histogram(
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        model,
        counters.request_inference_time,
    )
    yield _histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        model,
        counters.request_prefill_time,
    )
    yield _histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        model,
        counters.request_decode_time,
    )
    if config.lora_modules:
        yield _histogram(
            "vllm:lora_adapter_load_seconds",
            "Histogram of LoRA adapter loads into a GPU slot, in seconds.",
            model,
            counters.lora_adapter_load,
        )


def _cache_config(config: SimConfig) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels as vLLM 0.32 writes them (its CacheConfig's fields, as
    strings, and ``engine``), with the simulator's block size, block count and hash algorithm."""
    info = dict.fromkeys(_CACHE_CONFIG_NONE, "None")
    info.update(
        block_size=str(config.block_size),
        user_specified_block_size="True",
        gpu_memory_utilization="0.92",
        cache_dtype="auto",
        is_attention_free="False",
        enable_prefix_caching="True",
        prefix_caching_hash_algo=config.prefix_caching_hash_algo,
        prefix_cache_retention_interval="0",
        kv_cache_dtype_skip_layers="[]",
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
        mamba_cache_mode="none",
        enable_mamba_shared_prefix_checkpoint="False",
        replayssm_buffer_len="16",
        use_replayssm="False",
        use_kda_recoverssm="False",
        num_gpu_blocks=str(config.kv_cache_size),
        num_cpu_blocks="None",
        kv_cache_size_tokens=str(config.kv_cache_size * config.block_size),
        kv_sharing_fast_prefill="False",
        swa_bounded_replay="True",
        kv_offloading_backend="native",
        _block_size_resolved="True",
        engine=str(config.data_parallel_rank),
    )
    return info


_CACHE_CONFIG_NONE = (
    "kv_cache_layout", "prefix_match_unit", "num_gpu_blocks_override", "sliding_window",
    "mamba_page_size_padded", "skip_page_size_padded", "mamba_block_size",
    "effective_attention_block_size", "kv_cache_max_concurrency", "hash_block_size",
    "cache_hit_alignment_tokens", "kv_cache_memory_bytes", "kv_offloading_size",
)  # fmt: skip


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
