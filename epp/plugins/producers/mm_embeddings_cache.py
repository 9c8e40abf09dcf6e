"""``mm-embeddings-cache-producer``: which endpoints likely hold a request's multimodal embeddings.

Per endpoint a bounded LRU of multimodal content hashes the EPP sent there; ``produce`` writes, per
candidate, the request's unique items and those the endpoint's LRU holds (``EncoderCacheMatchInfo``)
for ``mm-embeddings-cache-scorer``; ``pre_request`` records the items on the picked endpoint.
Hashes come from the token producer's multimodal features, else from the chat body's typed media
blocks (``image_url``, ``video_url``, ``input_audio``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from epp import promlite
from epp.framework import CycleState, DataProducer, Endpoint, Handle, LLMRequest, PreRequest, register
from epp.framework.attributes import (
    MM_EMBEDDINGS_MATCH_INFO_KEY,
    TOKENIZED_PROMPT_KEY,
    EncoderCacheMatchInfo,
    MMItem,
)
from epp.framework.interfaces import EndpointEvent, EventType
from epp.framework.request import ApiKind
from epp.framework.results import SchedulingResult

__all__ = ["MMEmbeddingsCacheParams", "MMEmbeddingsCacheProducer", "request_items"]

DEFAULT_CACHE_SIZE_MB = 4096
BYTES_PER_ITEM = 2 << 20  # the assumed size of one tracked item (2 MiB)
_UNKNOWN_MODALITY = "unknown"
_BLOCK_MODALITY = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}

_LABELS = ("plugin_type", "plugin_name")
QUERIES = promlite.Counter(
    "llm_d_epp_encoder_cache_queries_total",
    "[ALPHA] Total number of multimodal item hash lookups made against the encoder-cache affinity LRU.",
    (*_LABELS, "modality"),
)
HITS = promlite.Counter(
    "llm_d_epp_encoder_cache_hits_total",
    "[ALPHA] Total number of multimodal item hash lookups that found a match in the encoder-cache "
    "affinity LRU, by endpoint.",
    (*_LABELS, "pod", "modality"),
)
HIT_RATIO = promlite.Histogram(
    "llm_d_epp_encoder_cache_hit_ratio",
    "[ALPHA] Ratio of matched multimodal items to total items per endpoint in an encoder-cache lookup.",
    _LABELS,
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
promlite.register(QUERIES, HITS, HIT_RATIO)


@dataclass(slots=True, frozen=True)
class MMEmbeddingsCacheParams:
    """``cacheSizeInMBPerServer`` (MiB, <= 0: 4096) sizes each endpoint's LRU at one entry per 2 MiB;
    ``cacheSizeInMB`` is the older spelling (the deploy sample still uses it)."""

    cache_size_in_mb_per_server: int = field(default=0, metadata={"key": "cacheSizeInMBPerServer"})
    cache_size_in_mb: int = field(default=0, metadata={"key": "cacheSizeInMB"})

    @property
    def entries_per_endpoint(self) -> int:
        mb = self.cache_size_in_mb_per_server or self.cache_size_in_mb
        if mb <= 0:
            mb = DEFAULT_CACHE_SIZE_MB
        return max(1, (mb << 20) // BYTES_PER_ITEM)


def _url(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        url = value.get("url")
        return url if isinstance(url, str) else ""
    return ""


def _block_items(payload: Mapping[str, Any]) -> Iterable[MMItem]:
    messages = payload.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            continue
        for block in content:
            if not isinstance(block, Mapping):
                continue
            kind = block.get("type")
            modality = _BLOCK_MODALITY.get(kind) if isinstance(kind, str) else None
            if modality is None:
                continue
            if modality == "audio" and kind == "input_audio":
                audio = block.get("input_audio")
                data = audio.get("data") if isinstance(audio, Mapping) else None
                ref = data if isinstance(data, str) else ""
            else:
                ref = _url(block.get(kind))
            if ref:
                yield MMItem(xxhash.xxh64_hexdigest(ref.encode("utf-8", "surrogatepass")), modality)


def request_items(request: LLMRequest) -> tuple[MMItem, ...]:
    """The request's unique multimodal items, in first-seen order (repeats count once)."""
    seen: dict[str, MMItem] = {}
    prompt = request.body.tokenized if request.body is not None else None
    if prompt is not None and prompt.mm_hashes:
        for h, _offset, _length in prompt.mm_hashes:
            if h and h not in seen:
                seen[h] = MMItem(h, _UNKNOWN_MODALITY)
    elif request.body is not None and request.body.api is ApiKind.CHAT_COMPLETIONS:
        for item in _block_items(request.body.payload):
            seen.setdefault(item.hash, item)
    return tuple(seen.values())


@register
class MMEmbeddingsCacheProducer(DataProducer, PreRequest):
    """Also an ``endpoint-notification-source`` extractor (a deleted endpoint's LRU is dropped)."""

    type_name = "mm-embeddings-cache-producer"
    accepts = "endpoint-events"
    Params = MMEmbeddingsCacheParams
    params: MMEmbeddingsCacheParams
    consumes = frozenset({TOKENIZED_PROMPT_KEY})
    produces = frozenset({MM_EMBEDDINGS_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: MMEmbeddingsCacheParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else MMEmbeddingsCacheParams()
        super().__init__(name, params, handle)
        self.capacity = params.entries_per_endpoint
        self._caches: dict[str, OrderedDict[str, None]] = {}
        self._state_key = f"{self.type_name}/{name}"
        self._ratio = HIT_RATIO.labels(self.type_name, name)

    def cached_items(self, endpoint_key: str) -> int:
        cache = self._caches.get(endpoint_key)
        return len(cache) if cache is not None else 0

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        items = request_items(request)
        if not items:
            return
        total = len(items)
        for item in items:
            QUERIES.labels(self.type_name, self.name, item.modality).inc()
        infos: dict[Endpoint, EncoderCacheMatchInfo] = {}
        for e in endpoints:
            key = e.metadata.key
            cache = self._caches.get(key)
            matched = tuple(i for i in items if i.hash in cache) if cache else ()
            for i in matched:
                HITS.labels(self.type_name, self.name, key, i.modality).inc()
            self._ratio.observe(len(matched) / total)
            infos[e] = EncoderCacheMatchInfo(matched, items)
        cycle[MM_EMBEDDINGS_MATCH_INFO_KEY] = infos
        cycle[self._state_key] = items

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        items: tuple[MMItem, ...] | None = cycle.pop(self._state_key, None)
        primary = result.primary
        if not items or primary is None:
            return
        for endpoint in primary.target_endpoints[:1]:
            self._record(endpoint.metadata.key, items)

    def _record(self, key: str, items: tuple[MMItem, ...]) -> None:
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = OrderedDict()
        for item in items:
            cache[item.hash] = None
            cache.move_to_end(item.hash)
        while len(cache) > self.capacity:
            cache.popitem(last=False)

    def extract_endpoint(self, event: EndpointEvent) -> None:
        if event.type == EventType.DELETE:
            self.remove_endpoint(event.endpoint.metadata.key)

    def remove_endpoint(self, key: str) -> None:
        self._caches.pop(key, None)
