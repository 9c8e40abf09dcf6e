"""``prefill-cost-scorer``: a prefix hit weighed against the prefill work queued ahead of it.

Each endpoint's predicted time to first token, in prompt tokens: the uncached prompt tokens of the
requests this plugin has sent there and not seen finish, plus this request's own uncached tokens
(weighted up as a miss), plus a per-request cost. Endpoints over a bounded load (in-flight requests
above ``loadBound`` times the mean) score 0, and ties break by rendezvous hashing of the prompt's
first characters, so cold requests of one prefix land together without piling up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework import (
    CycleState,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    RequestDone,
    SchedulingResult,
    Scorer,
    register,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY
from epp.plugins.producers.inflight_load import estimate_input_tokens, uncached_input_tokens
from epp.plugins.scorers._data_keys import check_producers
from epp.plugins.scorers._rendezvous import hash_rank

__all__ = ["PrefillCostParams", "PrefillCostScorer"]

TYPE_NAME = "prefill-cost-scorer"
_TIE_SPREAD = 0.02  # how far the hash order moves scores: enough to break ties, not to beat load


@dataclass(slots=True, frozen=True)
class PrefillCostParams:
    miss_penalty: float = 1.0
    request_cost_tokens: int = 64
    floor_tokens: int = 256
    load_bound: float = 1.1
    load_bound_min: int = 8
    hash_prefix_chars: int = 512
    prefix_match_info_producer_name: str = ""

    def validate(self) -> str | None:
        if not 0.0 <= self.miss_penalty <= 100.0:
            return f"missPenalty: must be between 0 and 100, got {self.miss_penalty:g}"
        if self.request_cost_tokens < 0:
            return f"requestCostTokens: must be non-negative, got {self.request_cost_tokens}"
        if self.floor_tokens < 1:
            return f"floorTokens: must be at least 1, got {self.floor_tokens}"
        if self.load_bound != 0.0 and self.load_bound < 1.0:
            return f"loadBound: must be 0 (off) or at least 1.0, got {self.load_bound:g}"
        if self.load_bound_min < 1:
            return f"loadBoundMin: must be at least 1, got {self.load_bound_min}"
        if self.hash_prefix_chars < 0:
            return f"hashPrefixChars: must be non-negative, got {self.hash_prefix_chars}"
        return None


class _Queue:
    """One endpoint's in-flight requests and their uncached prompt tokens."""

    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0


class _Charge:
    """A request's charges, released once (at request_done, or when the request is collected)."""

    __slots__ = ("charges",)

    def __init__(self) -> None:
        self.charges: list[tuple[_Queue, int]] = []

    def release(self) -> None:
        for queue, tokens in self.charges:
            queue.requests = max(0, queue.requests - 1)
            queue.tokens = max(0, queue.tokens - tokens)
        self.charges = []

    def __del__(self) -> None:
        if self.charges:
            try:
                self.release()
            except Exception:  # never raise from a finaliser
                pass


@register
class PrefillCostScorer(Scorer, PreRequest, RequestDone):
    type_name = TYPE_NAME
    category = "Distribution"
    Params = PrefillCostParams
    params: PrefillCostParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: PrefillCostParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else PrefillCostParams()
        super().__init__(name, params, handle)
        check_producers(handle, params)
        self._queues: dict[str, _Queue] = {}
        self._state_key = f"{TYPE_NAME}/{name}"
        self._uncached_key = f"{TYPE_NAME}/{name}/uncached"

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        n = len(endpoints)
        if n == 0:
            return []
        p = self.params
        infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY) or {}
        n_input = estimate_input_tokens(request)
        queues = self._queues
        miss = 1.0 + p.miss_penalty
        costs: list[float] = []
        uncached_by_key: dict[str, int] = {}
        in_flight: list[int] = []
        for e in endpoints:
            uncached = uncached_input_tokens(n_input, infos.get(e))
            uncached_by_key[e.metadata.key] = uncached
            q = queues.get(e.metadata.key)
            waiting, requests = (q.tokens, q.requests) if q is not None else (0, 0)
            in_flight.append(requests)
            costs.append(waiting + miss * uncached + p.request_cost_tokens * requests + p.floor_tokens)
        cycle[self._uncached_key] = uncached_by_key
        best = min(costs)
        out = [best / c for c in costs]
        if p.load_bound > 0.0 and n > 1:
            cap = max(p.load_bound_min, math.ceil(p.load_bound * (sum(in_flight) + 1) / n))
            if any(r < cap for r in in_flight):
                out = [s if r < cap else 0.0 for s, r in zip(out, in_flight, strict=True)]
        if p.hash_prefix_chars > 0 and n > 1:
            rank = hash_rank(
                request.body.prompt_text[: p.hash_prefix_chars].encode("utf-8", "surrogatepass"), endpoints
            )
            out = [s * (1.0 - _TIE_SPREAD * r) for s, r in zip(out, rank, strict=True)]
        return out

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        uncached_by_key: dict[str, int] | None = cycle.get(self._uncached_key)
        charge: _Charge | None = None
        for res in result.profile_results.values():
            if res is None or not res.target_endpoints:
                continue
            key = res.target_endpoints[0].metadata.key
            tokens = uncached_by_key.get(key) if uncached_by_key else None
            if tokens is None:
                tokens = uncached_input_tokens(estimate_input_tokens(request), None)
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = _Queue()
            q.requests += 1
            q.tokens += tokens
            if charge is None:
                charge = request.state[self._state_key] = _Charge()
            charge.charges.append((q, tokens))

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        charge: _Charge | None = request.state.pop(self._state_key, None)
        if charge is not None:
            charge.release()

    def remove_endpoint(self, key: str) -> None:
        """Forget an endpoint that left the pool (its requests' charges release harmlessly)."""
        self._queues.pop(key, None)

    def queue(self, key: str) -> tuple[int, int]:
        """``(requests, uncached tokens)`` in flight to endpoint ``key`` (for tests and debugging)."""
        q = self._queues.get(key)
        return (q.requests, q.tokens) if q is not None else (0, 0)
