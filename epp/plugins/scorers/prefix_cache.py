"""``prefix-cache-scorer``: prefer endpoints that probably hold the prompt's prefix in KV cache."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, register
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo, PrefixMatches
from epp.framework.params import OMIT_UNSET
from epp.plugins.producers.approx_prefix_cache import ApproxPrefixCacheParams
from epp.plugins.scorers._data_keys import check_producers

__all__ = ["PrefixCacheScorer", "PrefixCacheScorerParams"]


DEFAULT_MATCH_LENGTH_SCALE_TOKENS = 8192
_PRODUCER_FIELDS = frozenset(f.name for f in dataclasses.fields(ApproxPrefixCacheParams))


@dataclass(slots=True, frozen=True)
class PrefixCacheScorerParams:
    """The scorer's own parameters, and the producer parameters a user may put on it (None = not given)."""

    prefix_match_info_producer_name: str = ""
    match_length_weight: float = 0.0
    match_length_scale_tokens: int = DEFAULT_MATCH_LENGTH_SCALE_TOKENS
    # Migrated to the approx-prefix-cache-producer (printed there), so printed here only when given.
    auto_tune: bool | None = field(default=None, metadata=OMIT_UNSET)
    block_size_tokens: int | None = field(default=None, metadata=OMIT_UNSET)
    max_prefix_blocks_to_match: int | None = field(default=None, metadata=OMIT_UNSET)
    max_prefix_tokens_to_match: int | None = field(default=None, metadata=OMIT_UNSET)
    lru_capacity_per_server: int | None = field(default=None, metadata=OMIT_UNSET)
    block_size: int | None = field(default=None, metadata=OMIT_UNSET)

    def given(self) -> dict[str, Any]:
        """The producer parameters that were set, by field name."""
        return {
            f.name: v
            for f in dataclasses.fields(self)
            if f.name in _PRODUCER_FIELDS and (v := getattr(self, f.name)) is not None
        }

    def producer_params(self) -> ApproxPrefixCacheParams | None:
        given = self.given()
        return ApproxPrefixCacheParams(**given) if given else None

    def validate(self) -> str | None:
        if not 0.0 <= self.match_length_weight <= 1.0:
            return f"matchLengthWeight: must be between 0.0 and 1.0, got {self.match_length_weight}"
        if self.match_length_weight > 0.0 and self.match_length_scale_tokens <= 0:
            return (
                "matchLengthScaleTokens: must be greater than 0 when matchLengthWeight is greater than 0, "
                f"got {self.match_length_scale_tokens}"
            )
        params = self.producer_params()
        return params.validate() if params is not None else None


@register
class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache-scorer"
    category = "Affinity"
    Params = PrefixCacheScorerParams
    params: PrefixCacheScorerParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(self, name: str, params: PrefixCacheScorerParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        check_producers(handle, params)
        self._weight = params.match_length_weight
        self._scale = float(params.match_length_scale_tokens)

    def producer_params(self) -> ApproxPrefixCacheParams | None:
        """The ``approx-prefix-cache-producer`` parameters given on this scorer, or None."""
        params = self.params
        return params.producer_params() if isinstance(params, PrefixCacheScorerParams) else None

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
        if not infos:
            return [0.0] * len(endpoints)
        get = infos.get
        scores: dict[int, float] = {}  # id(info) -> score: the producer shares one info per match length
        out: list[float] = []
        append = out.append
        for e in endpoints:
            info = get(e)
            r = scores.get(id(info))
            if r is None:
                r = scores[id(info)] = self._info_score(info)
            append(r)
        return out

    def score_grouped(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> tuple[Iterable[Hashable], Callable[[Any], float]] | None:
        infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
        if not isinstance(infos, PrefixMatches):
            return None
        labels = infos.labels(endpoints)  # matched block counts
        if labels is None:
            return None
        info, score = infos.info, self._info_score
        return labels, lambda count: score(info(count))

    def _info_score(self, info: object) -> float:
        if not isinstance(info, PrefixCacheMatchInfo) or info.total_blocks <= 0:
            return 0.0
        r = info.match_blocks / info.total_blocks
        weight = self._weight
        if weight > 0.0:
            length = min(1.0, info.match_blocks * info.block_size_tokens / self._scale)
            r = weight * length * length + (1.0 - weight) * r
        return r
