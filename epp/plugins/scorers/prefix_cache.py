"""``prefix-cache-scorer``: prefer endpoints that probably hold the prompt's prefix in KV cache."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer, register
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.plugins.producers.approx_prefix_cache import ApproxPrefixCacheParams

__all__ = ["PrefixCacheScorer", "PrefixCacheScorerParams"]


@dataclass(slots=True, frozen=True)
class PrefixCacheScorerParams:
    """The producer parameters a user may put on the scorer (None = not given)."""

    auto_tune: bool | None = None
    block_size_tokens: int | None = None
    max_prefix_blocks_to_match: int | None = None
    max_prefix_tokens_to_match: int | None = None
    lru_capacity_per_server: int | None = None
    block_size: int | None = None

    def given(self) -> dict[str, Any]:
        """The parameters that were set, by field name."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def producer_params(self) -> ApproxPrefixCacheParams | None:
        given = self.given()
        return ApproxPrefixCacheParams(**given) if given else None

    def validate(self) -> str | None:
        params = self.producer_params()
        return params.validate() if params is not None else None


@register
class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache-scorer"
    category = "Affinity"
    Params = PrefixCacheScorerParams
    params: PrefixCacheScorerParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def producer_params(self) -> ApproxPrefixCacheParams | None:
        """The ``approx-prefix-cache-producer`` parameters given on this scorer, or None."""
        params = self.params
        return params.producer_params() if isinstance(params, PrefixCacheScorerParams) else None

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
        if not infos:
            return [0.0] * len(endpoints)
        get = infos.get
        ratios: dict[int, float] = {}  # id(info) -> ratio: the producer shares one info per match length
        out: list[float] = []
        append = out.append
        for e in endpoints:
            info = get(e)
            r = ratios.get(id(info))
            if r is None:
                if isinstance(info, PrefixCacheMatchInfo) and info.total_blocks > 0:
                    r = info.match_blocks / info.total_blocks
                else:
                    r = 0.0
                ratios[id(info)] = r
            append(r)
        return out
