"""``token-load-scorer``: prefer endpoints with fewer estimated tokens in flight from this EPP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework import CycleState, Endpoint, Handle, LLMRequest, Scorer, register
from epp.framework.attributes import INFLIGHT_LOAD_KEY, InFlightLoad

__all__ = ["TokenLoadParams", "TokenLoadScorer"]

DEFAULT_QUEUE_THRESHOLD_TOKENS = 4194304


@dataclass(slots=True, frozen=True)
class TokenLoadParams:
    queue_threshold_tokens: int = DEFAULT_QUEUE_THRESHOLD_TOKENS

    @property
    def threshold(self) -> int:
        t = self.queue_threshold_tokens
        return t if t > 0 else DEFAULT_QUEUE_THRESHOLD_TOKENS


@register
class TokenLoadScorer(Scorer):
    type_name = "token-load-scorer"
    category = "Distribution"
    Params = TokenLoadParams
    params: TokenLoadParams
    consumes = frozenset({INFLIGHT_LOAD_KEY})

    def __init__(
        self, name: str, params: TokenLoadParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else TokenLoadParams()
        super().__init__(name, params)
        self._threshold = float(params.threshold)

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        loads = cycle.get(INFLIGHT_LOAD_KEY)
        if not loads:
            return [1.0] * len(endpoints)
        get = loads.get
        t = self._threshold
        out: list[float] = []
        for e in endpoints:
            load = get(e)
            tokens = load.tokens if isinstance(load, InFlightLoad) else 0
            out.append(1.0 if tokens <= 0 else 1.0 - min(tokens, t) / t)
        return out
