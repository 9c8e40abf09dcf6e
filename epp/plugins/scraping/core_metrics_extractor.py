"""``core-metrics-extractor``: turns a scraped metrics page into an endpoint's ``Metrics``."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import structlog

from epp.framework import LORA_CPU, LORA_GPU, Endpoint, Extractor, Metrics, register
from epp.framework.endpoint_attributes import scalar_metric_key
from epp.framework.interfaces import ExtractResult, Handle
from epp.framework.params import ensure_valid
from epp.plugins.scraping.promtext import Selector, info_labels, lora_info

log = structlog.get_logger("epp.datalayer.extractor")

FALLBACK_ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
_RESERVED_ENGINE = "default"
MODEL_NAME_LABEL = "model_name"


@dataclass(slots=True, frozen=True)
class CustomMetricConfig:
    """One ``customMetrics`` entry: a scalar metric stored as an endpoint attribute."""

    attribute_key: str = ""
    metric_spec: str = ""


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """One ``engineConfigs`` entry; ``None`` = not given (inherit), ``""`` = disabled."""

    name: str = ""
    queued_requests_spec: str | None = None
    running_requests_spec: str | None = None
    kv_usage_spec: str | None = None
    lora_spec: str | None = None
    cache_info_spec: str | None = None
    cache_block_size_label_name: str | None = None
    cache_num_blocks_label_name: str | None = None
    cache_block_size_spec: str | None = None
    cache_num_blocks_spec: str | None = None
    custom_metrics: tuple[CustomMetricConfig, ...] | None = None
    lora_loaded_spec: str | None = None
    lora_gpu_loaded_spec: str | None = None
    lora_gpu_slots_spec: str | None = None

    def validate(self) -> str | None:
        problem = _validate_custom_metrics(self.custom_metrics or ())
        if problem:
            return problem
        if not self.name:
            return "name: an engine config needs a name"
        if self.name == _RESERVED_ENGINE:
            return f"name: the engine name {_RESERVED_ENGINE!r} is reserved"
        for f in _SPEC_FIELDS:
            spec = getattr(self, f.name)
            if spec:
                try:
                    Selector.parse(spec)
                except ValueError as e:
                    return f"{_camel(f.name)}: {e}"
        return None


BUILTIN_ENGINES: Mapping[str, EngineConfig] = MappingProxyType(
    {
        "vllm": EngineConfig(
            name="vllm",
            queued_requests_spec="vllm:num_requests_waiting",
            running_requests_spec="vllm:num_requests_running",
            kv_usage_spec="vllm:kv_cache_usage_perc",
            lora_spec="vllm:lora_requests_info",
            cache_info_spec="vllm:cache_config_info",
            cache_block_size_label_name="block_size",
            cache_num_blocks_label_name="num_gpu_blocks",
            lora_loaded_spec="vllm:lora_adapter_loaded",
            lora_gpu_loaded_spec="vllm:num_gpu_loaded_lora_adapters",
            lora_gpu_slots_spec="vllm:max_gpu_lora_adapters",
        ),
        "sglang": EngineConfig(
            name="sglang",
            queued_requests_spec="sglang:num_queue_reqs",
            running_requests_spec="sglang:num_running_reqs",
            kv_usage_spec="sglang:token_usage",
            cache_info_spec="sglang:cache_config_info",
            cache_block_size_label_name="page_size",
            cache_num_blocks_label_name="num_pages",
        ),
        "trtllm-serve": EngineConfig(
            name="trtllm-serve",
            queued_requests_spec="trtllm_num_requests_waiting",
            running_requests_spec="trtllm_num_requests_running",
            kv_usage_spec="trtllm_kv_cache_utilization",
            cache_block_size_spec="trtllm_kv_cache_tokens_per_block",
            cache_num_blocks_spec="trtllm_kv_cache_max_blocks",
        ),
        "triton-tensorrt-llm": EngineConfig(
            name="triton-tensorrt-llm",
            queued_requests_spec="nv_trt_llm_request_metrics{request_type=waiting}",
            running_requests_spec="nv_trt_llm_request_metrics{request_type=scheduled}",
            kv_usage_spec="nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
            cache_block_size_spec="nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}",
            cache_num_blocks_spec="nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}",
        ),
        # Triton Inference Server for non-LLM models (no KV cache): queue and executions only.
        "triton": EngineConfig(
            name="triton",
            queued_requests_spec="nv_inference_pending_request_count",
            running_requests_spec="nv_inference_exec_count",
        ),
    }
)


@dataclass(slots=True, frozen=True)
class CoreMetricsExtractorParams:
    engine_label_key: str = "llm-d.ai/engine-type"
    default_engine: str = "vllm"
    engine_configs: tuple[EngineConfig, ...] = ()

    def validate(self) -> str | None:
        seen: set[str] = set()
        for cfg in self.engine_configs:
            if cfg.name in seen:
                return f"engineConfigs: duplicate engine name {cfg.name!r}"
            seen.add(cfg.name)
        known = set(BUILTIN_ENGINES) | seen
        if self.default_engine not in known:
            names = ", ".join(sorted(known))
            return f"defaultEngine: unknown engine {self.default_engine!r} (known: {names})"
        if not self.engine_label_key:
            return "engineLabelKey: must not be empty"
        return None


@dataclass(slots=True, frozen=True)
class EngineMapping:
    """An engine's compiled selectors (``None`` = metric disabled)."""

    name: str
    queued: Selector | None
    running: Selector | None
    kv_usage: Selector | None
    lora: Selector | None
    cache_info: Selector | None
    cache_block_size_label: str
    cache_num_blocks_label: str
    cache_block_size: Selector | None
    cache_num_blocks: Selector | None
    custom: tuple[tuple[str, Selector], ...] = ()  # (attribute key, selector)
    lora_loaded: Selector | None = None
    lora_gpu_loaded: Selector | None = None
    lora_gpu_slots: Selector | None = None


@register
class CoreMetricsExtractor(Extractor):
    type_name = "core-metrics-extractor"
    Params = CoreMetricsExtractorParams

    def __init__(self, name: str, params: CoreMetricsExtractorParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.params: CoreMetricsExtractorParams = params
        ensure_valid(params)  # also when constructed directly, not through the loader
        configs = dict(BUILTIN_ENGINES)
        for cfg in params.engine_configs:
            configs[cfg.name] = _merge(configs.get(cfg.name), cfg)
        self.mappings: Mapping[str, EngineMapping] = MappingProxyType(
            {name: _compile(cfg) for name, cfg in configs.items()}
        )
        self.default_mapping = self.mappings[params.default_engine]
        self._label_key = params.engine_label_key
        self._unknown_logged: set[str] = set()

    def mapping_for(self, labels: Mapping[str, str]) -> EngineMapping:
        """The engine mapping of an endpoint with these labels (unknown engines use the default)."""
        engine = labels.get(self._label_key) or labels.get(FALLBACK_ENGINE_LABEL)
        if not engine:
            return self.default_mapping
        mapping = self.mappings.get(engine)
        if mapping is None:
            if engine not in self._unknown_logged:
                self._unknown_logged.add(engine)
                log.warning("unknown engine type, using the default mapping", engine=engine)
            return self.default_mapping
        return mapping

    def extract(self, endpoint: Endpoint, body: bytes) -> ExtractResult:
        mapping = self.mapping_for(endpoint.metadata.labels)
        result = extract_metrics(mapping, endpoint.metrics, body)
        if not mapping.custom:
            return result
        errors = list(result.errors)
        attributes = endpoint.attributes
        for key, selector in mapping.custom:
            value = _value(selector, body, errors)
            if value is not None:
                attributes[key] = value
        return ExtractResult(result.metrics, tuple(errors))


def extract_metrics(mapping: EngineMapping, previous: Metrics, body: bytes) -> ExtractResult:
    """A new snapshot from ``body`` (None when nothing was extracted) and the per-field errors."""
    errors: list[str] = []
    changes: dict[str, object] = {}
    _extract_values(
        (
            (mapping.queued, "waiting_queue_size", True),
            (mapping.running, "running_requests_size", True),
            (mapping.kv_usage, "kv_cache_usage_percent", False),
        ),
        body,
        changes,
        errors,
    )
    if mapping.running is not None:
        served = _served_models(mapping.running, body)
        if served and served != previous.served_models:
            changes["served_models"] = served
    if mapping.lora is not None:
        _extract_lora(mapping.lora, body, changes, errors)
    if mapping.lora_loaded is not None:
        _extract_residency(mapping, body, changes, previous.lora_residency)
    if mapping.cache_info is not None:
        _extract_cache_info(mapping, body, changes, errors)
    _extract_values(
        (
            (mapping.cache_block_size, "cache_block_size", True),
            (mapping.cache_num_blocks, "cache_num_blocks", True),
        ),
        body,
        changes,
        errors,
    )
    if not changes:
        return ExtractResult(None, tuple(errors))
    changes["update_time"] = time.monotonic()
    return ExtractResult(dataclasses.replace(previous, **changes), tuple(errors))  # type: ignore[arg-type]


def _extract_values(
    fields: Iterable[tuple[Selector | None, str, bool]],
    body: bytes,
    changes: dict[str, object],
    errors: list[str],
) -> None:
    """Set each ``(selector, attribute, as_int)`` field's value into ``changes`` (disabled: skipped)."""
    for selector, attr, as_int in fields:
        if selector is None:
            continue
        value = _value(selector, body, errors)
        if value is not None:
            changes[attr] = int(value) if as_int else value


def _value(selector: Selector, body: bytes, errors: list[str]) -> float | None:
    value = selector.value(body)
    if value is None:
        errors.append(f"metric {selector} not found")
        return None
    if not math.isfinite(value):
        errors.append(f"metric {selector} has a non-finite value {value}")
        return None
    return value


def _served_models(selector: Selector, body: bytes) -> tuple[str, ...]:
    """The distinct ``model_name`` label values of the selector's series, in page order."""
    names = (s.labels.get(MODEL_NAME_LABEL, "") for s in selector.samples(body, with_labels=True))
    return tuple(dict.fromkeys(n for n in names if n))


def _extract_lora(selector: Selector, body: bytes, changes: dict[str, object], errors: list[str]) -> None:
    info = lora_info(body, selector)
    if info is None:
        return  # vLLM exports the family only with LoRA enabled: absence is not an error
    changes["active_models"] = MappingProxyType(dict.fromkeys(info.running, 0))
    changes["waiting_models"] = MappingProxyType(dict.fromkeys(info.waiting, 0))
    if info.max_lora is None:
        errors.append(f"metric {selector}: invalid or missing max_lora label")
    else:
        changes["max_active_models"] = info.max_lora


def _extract_residency(
    mapping: EngineMapping, body: bytes, changes: dict[str, object], had_residency: bool
) -> None:
    """The adapters resident on the GPU and in the host cache (engines without LoRA, or older ones,
    export none of these families: not an error, the LoRA info series stays the only source)."""
    assert mapping.lora_loaded is not None
    levels: dict[str, str] = {}
    for sample in mapping.lora_loaded.samples(body, with_labels=True):
        name = sample.labels.get("adapter_name", "")
        level = sample.labels.get("level", "")
        if not name or sample.value <= 0 or level not in (LORA_GPU, LORA_CPU):
            continue
        if levels.get(name) != LORA_GPU:  # a GPU copy wins over a host-cache one
            levels[name] = level
    gpu = mapping.lora_gpu_loaded.value(body) if mapping.lora_gpu_loaded is not None else None
    if gpu is None and not levels:
        if had_residency:  # the engine stopped reporting (restarted without it): forget it
            changes["lora_residency"] = False
            changes["loaded_adapters"] = MappingProxyType({})
            changes["gpu_loaded_adapters"] = 0
        return
    changes["lora_residency"] = True
    changes["loaded_adapters"] = MappingProxyType(levels)
    on_gpu = sum(1 for level in levels.values() if level == LORA_GPU)
    changes["gpu_loaded_adapters"] = int(gpu) if gpu is not None and math.isfinite(gpu) else on_gpu
    slots = mapping.lora_gpu_slots.value(body) if mapping.lora_gpu_slots is not None else None
    if slots is not None and math.isfinite(slots) and slots >= 0:
        changes["max_active_models"] = int(slots)


def _extract_cache_info(
    mapping: EngineMapping, body: bytes, changes: dict[str, object], errors: list[str]
) -> None:
    assert mapping.cache_info is not None
    labels = info_labels(body, mapping.cache_info)
    if labels is None:
        errors.append(f"metric {mapping.cache_info} not found")
        return
    changes["cache_block_size"] = 0  # reference: reset first, set only from a valid label
    for label, attr in (
        (mapping.cache_block_size_label, "cache_block_size"),
        (mapping.cache_num_blocks_label, "cache_num_blocks"),
    ):
        if not label:
            continue
        try:
            changes[attr] = int(labels.get(label, ""))
        except ValueError:
            errors.append(f"metric {mapping.cache_info}: invalid or missing label {label!r}")


_SPEC_FIELDS = tuple(f for f in dataclasses.fields(EngineConfig) if f.name.endswith("_spec"))


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _merge(base: EngineConfig | None, override: EngineConfig) -> EngineConfig:
    """``override`` with its omitted (None) fields taken from the built-in ``base``."""
    if base is None:
        return override
    inherited = {
        f.name: getattr(base, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(override, f.name) is None
    }
    return dataclasses.replace(override, **inherited)


def _compile(cfg: EngineConfig) -> EngineMapping:
    def sel(spec: str | None) -> Selector | None:
        return Selector.parse(spec) if spec else None

    return EngineMapping(
        name=cfg.name,
        queued=sel(cfg.queued_requests_spec),
        running=sel(cfg.running_requests_spec),
        kv_usage=sel(cfg.kv_usage_spec),
        lora=sel(cfg.lora_spec),
        cache_info=sel(cfg.cache_info_spec),
        cache_block_size_label=cfg.cache_block_size_label_name or "",
        cache_num_blocks_label=cfg.cache_num_blocks_label_name or "",
        cache_block_size=sel(cfg.cache_block_size_spec),
        cache_num_blocks=sel(cfg.cache_num_blocks_spec),
        custom=tuple(
            (scalar_metric_key(c.attribute_key), Selector.parse(c.metric_spec))
            for c in cfg.custom_metrics or ()
        ),
        lora_loaded=sel(cfg.lora_loaded_spec),
        lora_gpu_loaded=sel(cfg.lora_gpu_loaded_spec),
        lora_gpu_slots=sel(cfg.lora_gpu_slots_spec),
    )


def _validate_custom_metrics(configs: Iterable[CustomMetricConfig]) -> str | None:
    seen: set[str] = set()
    for i, c in enumerate(configs):
        where = f"customMetrics[{i}]"
        if not c.attribute_key:
            return f"{where}.attributeKey: custom metric attributeKey cannot be empty"
        if c.attribute_key in seen:
            return f"{where}.attributeKey: custom metric attributeKey {c.attribute_key!r} is duplicated"
        seen.add(c.attribute_key)
        if not c.metric_spec:
            return f"{where}.metricSpec: custom metric {c.attribute_key!r} spec cannot be empty"
        try:
            Selector.parse(c.metric_spec)
        except ValueError as e:
            return f"{where}.metricSpec: custom metric {c.attribute_key!r}: {e}"
    return None
