"""``mm-embeddings-cache-producer`` and ``mm-embeddings-cache-scorer``: multimodal encoder-cache affinity."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from epp.framework import CycleState, ProfileRunResult, SchedulingResult
from epp.framework.attributes import MM_EMBEDDINGS_MATCH_INFO_KEY, TokenizedPrompt
from epp.framework.interfaces import EndpointEvent, EventType
from epp.framework.params import decode_params
from epp.plugins.producers.mm_embeddings_cache import (
    MMEmbeddingsCacheParams,
    MMEmbeddingsCacheProducer,
    request_items,
)
from epp.plugins.scorers.mm_embeddings_cache_scorer import MMEmbeddingsCacheScorer
from tests.unit.factories import chat, config, endpoints

SAMPLE = Path(__file__).resolve().parents[3] / "shared/reference/llm-d-configs/snapshot"


def _image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def _request(*urls: str, request_id: str = "r1"):  # type: ignore[no-untyped-def]
    return chat(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}, *map(_image, urls)]}],
        request_id=request_id,
    )


def _served(producer: MMEmbeddingsCacheProducer, request, eps, target) -> CycleState:  # type: ignore[no-untyped-def]
    cycle = CycleState()
    asyncio.run(producer.produce(cycle, request, eps))
    producer.pre_request(cycle, request, SchedulingResult({"d": ProfileRunResult([target])}, "d"))
    return cycle


def test_params_size_the_lru_per_endpoint_and_accept_the_older_spelling() -> None:
    assert MMEmbeddingsCacheParams().entries_per_endpoint == 2048  # 4096 MiB / 2 MiB
    assert (
        decode_params(MMEmbeddingsCacheParams, {"cacheSizeInMBPerServer": 10}, "p").entries_per_endpoint == 5
    )
    assert decode_params(MMEmbeddingsCacheParams, {"cacheSizeInMB": 2048}, "p").entries_per_endpoint == 1024
    assert (
        decode_params(MMEmbeddingsCacheParams, {"cacheSizeInMBPerServer": -1}, "p").entries_per_endpoint
        == 2048
    )
    assert MMEmbeddingsCacheParams(cache_size_in_mb_per_server=1).entries_per_endpoint == 1


def test_items_are_unique_and_come_from_the_tokenized_prompt_first() -> None:
    req = _request("http://a/1.png", "http://a/2.png", "http://a/1.png")
    items = request_items(req)
    assert [i.modality for i in items] == ["image", "image"]
    assert len({i.hash for i in items}) == 2
    req.body.tokenized = TokenizedPrompt([1, 2, 3], mm_hashes=(("h1", 0, 1), ("h1", 1, 1), ("h2", 2, 1)))
    assert [i.hash for i in request_items(req)] == ["h1", "h2"]
    assert request_items(chat([{"role": "user", "content": "text only"}])) == ()


def test_the_picked_endpoint_is_preferred_for_the_same_images() -> None:
    producer = MMEmbeddingsCacheProducer("mm", MMEmbeddingsCacheParams())
    scorer = MMEmbeddingsCacheScorer("s")
    eps = endpoints(3)
    first = _served(producer, _request("http://a/1.png", "http://a/2.png"), eps, eps[1])
    assert [scorer.score(first, _request(), eps)] == [[0.0, 0.0, 0.0]]  # nothing cached before
    cycle = CycleState()
    asyncio.run(producer.produce(cycle, _request("http://a/1.png", "http://b/3.png", request_id="r2"), eps))
    assert list(scorer.score(cycle, _request(), eps)) == [0.0, 0.5, 0.0]
    info = cycle[MM_EMBEDDINGS_MATCH_INFO_KEY][eps[1]]
    assert len(info.matched) == 1 and len(info.items) == 2


def test_lru_is_bounded_and_a_deleted_endpoint_is_forgotten() -> None:
    producer = MMEmbeddingsCacheProducer(
        "mm", MMEmbeddingsCacheParams(cache_size_in_mb_per_server=4)
    )  # 2 entries
    eps = endpoints(2)
    for i in range(5):
        _served(producer, _request(f"http://a/{i}.png", request_id=f"r{i}"), eps, eps[0])
    assert producer.cached_items(eps[0].metadata.key) == 2
    cycle = CycleState()
    asyncio.run(producer.produce(cycle, _request("http://a/0.png", "http://a/4.png"), eps))
    assert cycle[MM_EMBEDDINGS_MATCH_INFO_KEY][eps[0]].ratio == 0.5  # 0 was evicted, 4 is recent
    producer.extract_endpoint(EndpointEvent(EventType.DELETE, eps[0]))
    assert producer.cached_items(eps[0].metadata.key) == 0


def test_requests_without_media_produce_nothing_and_score_zero() -> None:
    producer = MMEmbeddingsCacheProducer("mm")
    cycle = CycleState()
    req = chat([{"role": "user", "content": "hello"}])
    asyncio.run(producer.produce(cycle, req, endpoints(2)))
    assert MM_EMBEDDINGS_MATCH_INFO_KEY not in cycle
    assert list(MMEmbeddingsCacheScorer("s").score(cycle, req, endpoints(2))) == [0.0, 0.0]


def test_lookups_are_counted() -> None:
    producer = MMEmbeddingsCacheProducer("mm-metrics")
    eps = endpoints(1)
    _served(producer, _request("http://m/1.png"), eps, eps[0])
    _served(producer, _request("http://m/1.png", request_id="r2"), eps, eps[0])
    labels = {"plugin_type": "mm-embeddings-cache-producer", "plugin_name": "mm-metrics"}
    assert (
        REGISTRY.get_sample_value("llm_d_epp_encoder_cache_queries_total", {**labels, "modality": "image"})
        == 2
    )
    hits = {**labels, "pod": eps[0].metadata.key, "modality": "image"}
    assert REGISTRY.get_sample_value("llm_d_epp_encoder_cache_hits_total", hits) == 1  # the second lookup


def test_scorer_alone_gets_the_producer_created() -> None:
    loaded = config(
        "plugins:\n- type: mm-embeddings-cache-scorer\n- type: max-score-picker\n"
        "- type: single-profile-handler\n"
        "schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: mm-embeddings-cache-scorer\n"
        "  - pluginRef: max-score-picker\n"
    )
    assert any(p.type_name == "mm-embeddings-cache-producer" for p in loaded.plugins.values())


@pytest.mark.skipif(
    not SAMPLE.is_dir(), reason="../shared/reference/llm-d-configs is absent (data from outside)"
)
def test_the_deploy_sample_loads() -> None:
    text = (SAMPLE / "deploy__config__epp-mm-embeddings-cache-config.yaml").read_text()
    loaded = config(text.split("kind: EndpointPickerConfig\n", 1)[1])
    producer = loaded.plugins["mm-embeddings-cache-producer"]
    assert isinstance(producer, MMEmbeddingsCacheProducer) and producer.capacity == 1024
