"""Prometheus metrics of the approximate prefix index (``approx-prefix-cache-producer``).

Kept apart from ``epp.metrics`` so that the metric objects live with the plugin that records them.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from prometheus_client import Gauge

from epp import promlite

HIT_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
HIT_BYTES_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class _Sized(Protocol):
    def size(self) -> int: ...


PREFIX_INDEXER_SIZE = Gauge(
    "inference_extension_prefix_indexer_size",
    "[ALPHA] Size of the prefix indexer.",
)
PREFIX_INDEXER_HIT_RATIO = promlite.Histogram(
    "inference_extension_prefix_indexer_hit_ratio",
    "[ALPHA] Ratio of prefix length matched to total prefix length in the cache lookup.",
    buckets=HIT_RATIO_BUCKETS,
)
PREFIX_INDEXER_HIT_BYTES = promlite.Histogram(
    "inference_extension_prefix_indexer_hit_bytes",
    "[ALPHA] Length of the prefix match in number of bytes in the cache lookup.",
    buckets=HIT_BYTES_BUCKETS,
)

promlite.register(PREFIX_INDEXER_HIT_RATIO, PREFIX_INDEXER_HIT_BYTES)
_hit_ratio = PREFIX_INDEXER_HIT_RATIO.labels()
_hit_bytes = PREFIX_INDEXER_HIT_BYTES.labels()

_live_indexes: weakref.WeakSet[_Sized] = weakref.WeakSet()


def _total_size() -> float:
    return float(sum(ix.size() for ix in list(_live_indexes)))


PREFIX_INDEXER_SIZE.set_function(_total_size)


def track_index(index: _Sized) -> None:
    """Count ``index`` in ``inference_extension_prefix_indexer_size`` for as long as it lives."""
    _live_indexes.add(index)


def record_match(matched_bytes: int, total_bytes: int) -> None:
    """The reference's ``RecordPrefixCacheMatch``: hit bytes always, the ratio when total > 0."""
    _hit_bytes.observe(matched_bytes)
    if total_bytes > 0:
        _hit_ratio.observe(matched_bytes / total_bytes)
