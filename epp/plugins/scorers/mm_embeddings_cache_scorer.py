"""``mm-embeddings-cache-scorer``: prefer endpoints likely to hold the request's multimodal embeddings.

Score = matched items / request items of the ``EncoderCacheMatchInfo`` that
``mm-embeddings-cache-producer`` wrote; 0 without one (or for a request without media).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, register
from epp.framework.attributes import MM_EMBEDDINGS_MATCH_INFO_KEY, EncoderCacheMatchInfo

__all__ = ["MMEmbeddingsCacheScorer", "MMEmbeddingsCacheScorerParams"]


@dataclass(slots=True, frozen=True)
class MMEmbeddingsCacheScorerParams:
    producer_name: str = ""  # accepted for the reference's parameter; one producer feeds the key


@register
class MMEmbeddingsCacheScorer(Scorer):
    type_name = "mm-embeddings-cache-scorer"
    category = "Affinity"
    Params = MMEmbeddingsCacheScorerParams
    consumes = frozenset({MM_EMBEDDINGS_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: MMEmbeddingsCacheScorerParams | None = None, handle: Handle | None = None
    ) -> None:
        super().__init__(name, params if params is not None else MMEmbeddingsCacheScorerParams())

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        infos = cycle.get(MM_EMBEDDINGS_MATCH_INFO_KEY)
        if not infos:
            return [0.0] * len(endpoints)
        out: list[float] = []
        for e in endpoints:
            info = infos.get(e)
            out.append(info.ratio if isinstance(info, EncoderCacheMatchInfo) else 0.0)
        return out
