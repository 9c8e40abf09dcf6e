"""``latency-scorer``: score endpoints by predicted latency headroom against the request's SLOs.

Reads ``LatencyPredictionInfo`` (``predicted-latency-producer``); without any prediction it falls
back to a composite of free KV cache, relative queue depth and prefix-cache match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, register
from epp.framework.attributes import (
    LATENCY_PREDICTION_INFO_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from epp.plugins.scorers._data_keys import check_producers

__all__ = ["LatencyScorer", "LatencyScorerParams"]

LEAST = "least"
MOST = "most"
_W_MAX = 100
_EPS = 1e-9


@dataclass(slots=True, frozen=True)
class LatencyScorerParams:
    ttft_weight: float = field(default=0.8, metadata={"key": "ttftWeight"})
    tpot_weight: float = field(default=0.2, metadata={"key": "tpotWeight"})
    headroom_selection_strategy: str = LEAST
    composite_kv_weight: float = field(default=1.0, metadata={"key": "compositeKVWeight"})
    composite_queue_weight: float = 1.0
    composite_prefix_weight: float = 1.0
    latency_prediction_info_producer_name: str = ""
    prefix_match_info_producer_name: str = ""

    def validate(self) -> str | None:
        for key, value in (
            ("ttftWeight", self.ttft_weight),
            ("tpotWeight", self.tpot_weight),
            ("compositeKVWeight", self.composite_kv_weight),
            ("compositeQueueWeight", self.composite_queue_weight),
            ("compositePrefixWeight", self.composite_prefix_weight),
        ):
            if not value >= 0:
                return f"{key}: must be >= 0, got {value:g}"
        if self.headroom_selection_strategy not in (LEAST, MOST):
            return (
                f'headroomSelectionStrategy: must be "{LEAST}" or "{MOST}", '
                f'got "{self.headroom_selection_strategy}"'
            )
        return None


def _normalized(a: float, b: float) -> tuple[float, float]:
    total = a + b
    return (1.0, 0.0) if total <= 0 else (a / total, b / total)


@register
class LatencyScorer(Scorer):
    type_name = "latency-scorer"
    category = "Balance"
    Params = LatencyScorerParams
    params: LatencyScorerParams
    consumes = frozenset({LATENCY_PREDICTION_INFO_KEY, PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: LatencyScorerParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else LatencyScorerParams()
        super().__init__(name, params, handle)
        check_producers(handle, params)
        self._alpha, self._beta = _normalized(params.ttft_weight, params.tpot_weight)
        self._most = params.headroom_selection_strategy == MOST

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        infos = cycle.get(LATENCY_PREDICTION_INFO_KEY)
        if not infos:
            return self._composite(cycle, endpoints)
        scores = [0.0] * len(endpoints)
        positive: list[tuple[int, float, float]] = []  # (index, ttft headroom, tpot headroom)
        negative: list[tuple[int, LatencyPredictionInfo]] = []
        for i, e in enumerate(endpoints):
            info = infos.get(e)
            if not isinstance(info, LatencyPredictionInfo):
                positive.append((i, 0.0, 0.0))  # no prediction: counted with the positive endpoints
            elif info.ttft_headroom < 0 or info.tpot_headroom < 0:
                negative.append((i, info))
            else:
                positive.append((i, info.ttft_headroom, info.tpot_headroom))
        if len(positive) == len(endpoints) and not any(
            isinstance(infos.get(e), LatencyPredictionInfo) for e in endpoints
        ):
            return self._composite(cycle, endpoints)
        if positive:
            self._score_bucket(positive, scores, force_least=False)
            return scores
        idle = [(i, n.ttft_headroom, n.tpot_headroom) for i, n in negative if n.dispatched_request_count == 0]
        if idle:
            self._score_bucket(idle, scores, force_least=True)
            return scores
        tpot_only: list[tuple[int, float, float]] = []
        ttft_only: list[tuple[int, float, float]] = []
        both: list[tuple[int, float, float]] = []
        for i, n in negative:
            item = (i, n.ttft_headroom, n.tpot_headroom)
            ttft_neg, tpot_neg = n.ttft_headroom < 0, n.tpot_headroom < 0
            if ttft_neg and not tpot_neg:
                ttft_only.append(item)
            elif tpot_neg and not ttft_neg:
                tpot_only.append(item)
            else:
                both.append(item)
        bucket = tpot_only or ttft_only or both
        self._score_bucket(bucket, scores, force_least=True)
        return scores

    def _score_bucket(
        self, bucket: list[tuple[int, float, float]], scores: list[float], *, force_least: bool
    ) -> None:
        """Min-max normalise ``|headroom|`` per dimension, blend, and map to ``(int(x·100)+1)/100``."""
        alpha, beta = self._alpha, self._beta
        ttfts = [abs(t) for _, t, _ in bucket]
        tpots = [abs(p) for _, _, p in bucket]
        min_ttft, min_tpot = min(ttfts), min(tpots)
        ttft_range = max(ttfts) - min_ttft
        tpot_range = max(tpots) - min_tpot
        if ttft_range <= _EPS and tpot_range > _EPS:
            alpha, beta = 0.0, 1.0
        elif tpot_range <= _EPS and ttft_range > _EPS:
            alpha, beta = 1.0, 0.0
        most = self._most and not force_least
        for (i, _, _), ht, hp in zip(bucket, ttfts, tpots, strict=True):
            n_ttft = (ht - min_ttft) / ttft_range if ttft_range > _EPS else 0.5
            n_tpot = (hp - min_tpot) / tpot_range if tpot_range > _EPS else 0.5
            combined = alpha * n_ttft + beta * n_tpot
            x = combined if most else 1.0 - combined
            scores[i] = (int(x * _W_MAX) + 1) / _W_MAX

    def _composite(self, cycle: CycleState, endpoints: list[Endpoint]) -> list[float]:
        """``wkv·(1 - kv) + wq·(maxQ - q)/maxQ + wp·prefix`` with weights normalised to sum 1."""
        p = self.params
        wkv, wq, wp = p.composite_kv_weight, p.composite_queue_weight, p.composite_prefix_weight
        total = wkv + wq + wp
        if total <= 0:
            wkv, wq, wp, total = 1.0, 0.0, 0.0, 1.0
        wkv, wq, wp = wkv / total, wq / total, wp / total
        matches = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY) or {}
        max_q = max((e.metrics.waiting_queue_size for e in endpoints), default=0)
        out: list[float] = []
        for e in endpoints:
            m = e.metrics
            rel_queue = (max_q - m.waiting_queue_size) / max_q if max_q > 0 else 1.0
            info = matches.get(e)
            prefix = info.ratio if isinstance(info, PrefixCacheMatchInfo) else 0.0
            composite = wkv * (1.0 - m.kv_cache_usage_percent) + wq * rel_queue + wp * prefix
            out.append(_round_half_away(_W_MAX * composite) / _W_MAX)
        return out


def _round_half_away(x: float) -> int:
    """Go's ``math.Round``: halves away from zero."""
    return int(x + 0.5) if x >= 0 else -int(-x + 0.5)
