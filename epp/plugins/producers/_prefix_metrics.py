"""Prometheus metrics of the approximate prefix index (``approx-prefix-cache-producer``).

Kept apart from ``epp.metrics`` so that the metric objects live with the plugin that records them.
Recorded per plugin under ``llm_d_epp_prefix_indexer_*``; the deprecated unlabelled
``inference_extension_prefix_indexer_*`` are rendered from them at scrape time.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from epp import promlite

HIT_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
HIT_BYTES_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PLUGIN_LABELS = ("plugin_name", "plugin_type")


class _Sized(Protocol):
    def size(self) -> int: ...


_live_indexes: weakref.WeakKeyDictionary[_Sized, tuple[str, str]] = weakref.WeakKeyDictionary()


class _SizeGauge(promlite.Gauge):
    """The live indexes' sizes, read at scrape time, summed per plugin."""

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        sizes: dict[tuple[str, ...], promlite.Value] = {}
        for index, key in list(_live_indexes.items()):
            v = sizes.get(key)
            if v is None:
                v = sizes[key] = promlite.Value()
            v.value += index.size()
        return list(sizes.items())


PREFIX_INDEXER_SIZE = _SizeGauge(
    "llm_d_epp_prefix_indexer_size", "[ALPHA] Size of the prefix indexer.", PLUGIN_LABELS
)
PREFIX_INDEXER_HIT_RATIO = promlite.Histogram(
    "llm_d_epp_prefix_indexer_hit_ratio",
    "[ALPHA] Ratio of prefix length matched to total prefix length in the cache lookup.",
    PLUGIN_LABELS,
    buckets=HIT_RATIO_BUCKETS,
)
PREFIX_INDEXER_HIT_BYTES = promlite.Histogram(
    "llm_d_epp_prefix_indexer_hit_bytes",
    "[ALPHA] Length of the prefix match in number of bytes in the cache lookup.",
    PLUGIN_LABELS,
    buckets=HIT_BYTES_BUCKETS,
)
_DEPRECATED = "[ALPHA] [Deprecated: Use {}] {}"
promlite.register(
    PREFIX_INDEXER_SIZE,
    PREFIX_INDEXER_HIT_RATIO,
    PREFIX_INDEXER_HIT_BYTES,
    promlite.alias(
        PREFIX_INDEXER_SIZE,
        "inference_extension_prefix_indexer_size",
        _DEPRECATED.format(PREFIX_INDEXER_SIZE.name, "Size of the prefix indexer."),
        (),
    ),
    promlite.alias(
        PREFIX_INDEXER_HIT_RATIO,
        "inference_extension_prefix_indexer_hit_ratio",
        _DEPRECATED.format(
            PREFIX_INDEXER_HIT_RATIO.name,
            "Ratio of prefix length matched to total prefix length in the cache lookup.",
        ),
        (),
    ),
    promlite.alias(
        PREFIX_INDEXER_HIT_BYTES,
        "inference_extension_prefix_indexer_hit_bytes",
        _DEPRECATED.format(
            PREFIX_INDEXER_HIT_BYTES.name,
            "Length of the prefix match in number of bytes in the cache lookup.",
        ),
        (),
    ),
    owners=("approx-prefix-cache-producer",),
)

# The precise producer's prediction for the endpoint it picked: prompt tokens believed cached there,
# against the prompt's tokens (the reference's KV-cache dashboard divides their sums: a hit rate).
TOKEN_BUCKETS = (
    0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip
PREDICTED_CACHED_TOKENS = promlite.Histogram(
    "llm_d_epp_prefix_predicted_cached_tokens",
    "[ALPHA] Prompt tokens predicted to be in the picked endpoint's prefix cache, per request.",
    PLUGIN_LABELS,
    buckets=TOKEN_BUCKETS,
)
PROMPT_TOKENS = promlite.Histogram(
    "llm_d_epp_prefix_prompt_tokens",
    "[ALPHA] Prompt tokens of the requests the prefix cache was looked up for.",
    PLUGIN_LABELS,
    buckets=TOKEN_BUCKETS,
)
promlite.register(PREDICTED_CACHED_TOKENS, PROMPT_TOKENS, owners=("precise-prefix-cache-producer",))


class PluginHits:
    """One plugin's hit histograms, bound once (``record_match`` per request)."""

    __slots__ = ("bytes", "ratio")

    def __init__(self, plugin_name: str, plugin_type: str) -> None:
        self.ratio = PREFIX_INDEXER_HIT_RATIO.labels(plugin_name, plugin_type)
        self.bytes = PREFIX_INDEXER_HIT_BYTES.labels(plugin_name, plugin_type)


def track_index(index: _Sized, plugin_name: str, plugin_type: str) -> PluginHits:
    """Count ``index`` in the size gauge for as long as it lives; the plugin's hit histograms."""
    _live_indexes[index] = (plugin_name, plugin_type)
    return PluginHits(plugin_name, plugin_type)


def record_match(hits: PluginHits, matched_bytes: int, total_bytes: int) -> None:
    """The reference's ``RecordPrefixCacheMatch``: hit bytes always, the ratio when total > 0."""
    hits.bytes.observe(matched_bytes)
    if total_bytes > 0:
        hits.ratio.observe(matched_bytes / total_bytes)


class PredictedHits:
    """One plugin's predicted-cached and prompt token histograms, bound once."""

    __slots__ = ("cached", "prompt")

    def __init__(self, plugin_name: str, plugin_type: str) -> None:
        self.cached = PREDICTED_CACHED_TOKENS.labels(plugin_name, plugin_type)
        self.prompt = PROMPT_TOKENS.labels(plugin_name, plugin_type)

    def record(self, cached_tokens: int, prompt_tokens: int) -> None:
        self.cached.observe(min(cached_tokens, prompt_tokens))
        self.prompt.observe(prompt_tokens)
