"""The simulator's prefill/decode disaggregation metrics: ``vllm:prompt_tokens_by_source``.

vLLM splits the prompt tokens by where their KV came from: computed here (``local_compute``), this
engine's prefix cache (``local_cache_hit``) or a KV transfer from a remote prefill worker
(``external_kv_transfer``). A decode-role simulator given ``kv_transfer_params`` skips the prefill
time of the transferred tokens and counts them as ``external_kv_transfer``, so the gain is visible.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.dev.sim.engine import Engine

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class PromptSourceCollector(Collector):
    """``vllm:prompt_tokens_by_source_total{model_name, source}`` from the engine's counters."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        counters = self._engine.snapshot().counters
        external = counters.external_kv_tokens
        cached = counters.prefix_cache_hits
        computed = max(0, counters.prompt_tokens - cached - external)
        family = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=["model_name", "source"],
        )
        model = self._engine.config.model
        for source, value in zip(SOURCES, (computed, cached, external), strict=True):
            family.add_metric([model, source], value)
        yield family
