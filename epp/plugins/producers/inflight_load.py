"""``inflight-load-producer``: requests and estimated tokens this EPP has in flight per endpoint."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epp.framework import (
    CycleState,
    DataProducer,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    RequestDone,
    ResponseHeaderProcessor,
    ResponseInfo,
    SchedulingResult,
    register,
)
from epp.framework.attributes import (
    INFLIGHT_LOAD_KEY,
    OUTLEN_BUCKET_KEY,
    OUTLEN_OUTPUT_TOKENS,
    PREFIX_CACHE_MATCH_INFO_KEY,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from epp.framework.cross_replica import SharedValue, fold_sum

__all__ = [
    "DEFAULT_OUTPUT_RATIO",
    "InFlightLoadParams",
    "InFlightLoadProducer",
    "estimate_input_tokens",
    "estimate_output_tokens",
    "estimate_tokens",
]

PREFILL_PROFILE = "prefill"
SWEEP_INTERVAL_SECONDS = 30.0
DEFAULT_OUTPUT_RATIO = 1.5
_ZERO = InFlightLoad(tokens=0, requests=0)
_CLIENT_OUTPUT_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(slots=True, frozen=True)
class InFlightLoadParams:
    add_estimated_output_tokens: bool = False
    output_ratio: float | None = DEFAULT_OUTPUT_RATIO  # None (null): DEFAULT_OUTPUT_RATIO
    max_estimated_output_tokens: int | None = None  # None: no cap

    def effective(self) -> InFlightLoadParams:
        """With the output ratio used (null means the default)."""
        if self.output_ratio is None:
            return dataclasses.replace(self, output_ratio=DEFAULT_OUTPUT_RATIO)
        return self

    def validate(self) -> str | None:
        if self.output_ratio is not None and self.output_ratio < 0:
            return f"outputRatio: must be non-negative, got {self.output_ratio:g}"
        if self.max_estimated_output_tokens is not None and self.max_estimated_output_tokens < 0:
            return f"maxEstimatedOutputTokens: must be non-negative, got {self.max_estimated_output_tokens}"
        return None


def _valid_load(v: Any) -> bool:
    """``[requests, tokens]``, two non-negative ints."""
    return (
        isinstance(v, list)
        and len(v) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 53 for x in v)
    )


def _round_half_up(x: float) -> int:
    """Go's ``math.Round`` for x >= 0 (Python's ``round`` rounds half to even)."""
    return int(x + 0.5)


def estimate_input_tokens(request: LLMRequest) -> int:
    """The request's input tokens: exact when a token-producer tokenized the prompt, else a quarter
    of its size (or of its prompt text when size is unknown)."""
    tp = request.body.tokenized
    if tp is not None and tp.exact:
        return len(tp.token_ids)
    if request.request_size_bytes > 0:
        return request.request_size_bytes // 4
    return _round_half_up(len(request.body.prompt_text) / 4)


def _client_output_cap(request: LLMRequest) -> int | None:
    payload = request.body.payload
    for key in _CLIENT_OUTPUT_CAPS:
        v = payload.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return None


def estimate_output_tokens(
    request: LLMRequest, n_input: int, ratio: float = DEFAULT_OUTPUT_RATIO, cap: int | None = None
) -> int:
    """``min(round(n_input * ratio), the client's output limit, cap)`` (limits only when set).

    With an ``outlen-bucket`` attribute the estimate is the bucket's (LONG 4096, SHORT 100, UNKNOWN
    1000 tokens) instead of the ratio's, and a client limit of 0 means none."""
    bucket = request.state.get(OUTLEN_BUCKET_KEY)
    if bucket is not None:
        est = OUTLEN_OUTPUT_TOKENS.get(bucket, OUTLEN_OUTPUT_TOKENS["UNKNOWN"])
        client = _client_output_cap(request)
        if client is not None and 0 < client < est:
            est = client
        return est if cap is None or cap >= est else cap
    if n_input <= 0:
        return 0
    est = _round_half_up(n_input * ratio)
    client = _client_output_cap(request)
    if client is not None and client < est:
        est = client
    if cap is not None and cap < est:
        est = cap
    return est


def estimate_tokens(request: LLMRequest) -> int:
    """Input estimate plus 1.5x for the output: ``input + round(1.5 * input)`` (no limits)."""
    n_input = estimate_input_tokens(request)
    return n_input + _round_half_up(DEFAULT_OUTPUT_RATIO * n_input)


def uncached_input_tokens(n_input: int, info: object) -> int:
    """The input the endpoint must still compute: the unmatched prefix blocks plus the unindexed tail."""
    if not isinstance(info, PrefixCacheMatchInfo) or info.block_size_tokens <= 0:
        return max(0, n_input)
    indexed = info.total_blocks * info.block_size_tokens
    matched = info.match_blocks * info.block_size_tokens
    return max(0, indexed - matched) + max(0, n_input - indexed)


class _Counter:
    """One endpoint's in-flight requests and tokens; ``load`` is the snapshot handed to scorers."""

    __slots__ = ("load", "requests", "tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.load = _ZERO

    def add(self, tokens: int) -> None:
        self.requests += 1
        self.tokens += tokens
        self.load = InFlightLoad(tokens=self.tokens, requests=self.requests)

    def sub(self, tokens: int) -> None:
        self.requests = max(0, self.requests - 1)
        self.sub_tokens(tokens)

    def sub_tokens(self, tokens: int) -> None:
        self.tokens = max(0, self.tokens - tokens)
        self.load = (
            InFlightLoad(tokens=self.tokens, requests=self.requests)
            if self.requests or self.tokens
            else _ZERO
        )


class _Ledger:
    """A request's unreleased charges: ``(counter, tokens, is_prefill)``. Each is released once."""

    __slots__ = ("charges", "owner")

    def __init__(self, owner: InFlightLoadProducer) -> None:
        self.owner = owner
        self.charges: list[tuple[_Counter, int, bool]] = []

    def release(self, prefill_only: bool = False) -> None:
        if not self.charges:
            return
        keep: list[tuple[_Counter, int, bool]] = []
        for charge in self.charges:
            counter, tokens, is_prefill = charge
            if prefill_only and not is_prefill:
                keep.append(charge)
                continue
            counter.sub(tokens)
            self.owner._outstanding -= 1
        self.charges = keep

    def release_tokens(self) -> None:
        """Give back the tokens of the remaining charges; their requests stay counted."""
        charges = self.charges
        for i, (counter, tokens, is_prefill) in enumerate(charges):
            if tokens:
                counter.sub_tokens(tokens)
                charges[i] = (counter, 0, is_prefill)

    def __del__(self) -> None:
        # the request object went away without request_done: give its charges back
        if self.charges:
            try:
                self.release()
            except Exception:  # never raise from a finaliser (e.g. at interpreter shutdown)
                pass


@register
class InFlightLoadProducer(DataProducer, PreRequest, ResponseHeaderProcessor, RequestDone):
    """PreRequest charges every picked profile's first target with the request's uncached input
    tokens (plus the estimated output with ``addEstimatedOutputTokens``); at the response headers
    the ``prefill`` charge is released, and without the output estimate every charge's tokens too
    (prefill is over); ``request_done`` releases the rest.

    A charge remembers the counter it incremented and is released once, also when the request
    object is collected without ``request_done``; counters never go below 0. Counters of endpoints
    that left the pool are dropped (``remove_endpoint``, or a lazy check every 30 s).
    """

    type_name = "inflight-load-producer"
    Params = InFlightLoadParams
    params: InFlightLoadParams
    produces = frozenset({INFLIGHT_LOAD_KEY})

    def __init__(
        self, name: str, params: InFlightLoadParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else InFlightLoadParams()
        super().__init__(name, params, handle)
        self._handle = handle
        self._add_output = params.add_estimated_output_tokens
        self._ratio = DEFAULT_OUTPUT_RATIO if params.output_ratio is None else params.output_ratio
        self._output_cap = params.max_estimated_output_tokens
        self._counters: dict[str, _Counter] = {}
        self._outstanding = 0  # unreleased charges; 0 means every counter is 0
        self._peers: dict[str, InFlightLoad] = {}  # the other replicas' summed loads (a syncer)
        self._state_key = f"{self.type_name}/{name}"
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_SECONDS

    # --- request path -------------------------------------------------------------------------

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        peers = self._peers
        if self._outstanding <= 0 and not peers:
            cycle[INFLIGHT_LOAD_KEY] = dict.fromkeys(endpoints, _ZERO)
            return
        counters = self._counters
        out: dict[Endpoint, InFlightLoad] = {}
        for e in endpoints:
            key = e.metadata.key
            c = counters.get(key)
            local = c.load if c is not None else _ZERO
            p = peers.get(key) if peers else None
            out[e] = (
                local if p is None else InFlightLoad(local.tokens + p.tokens, local.requests + p.requests)
            )
        cycle[INFLIGHT_LOAD_KEY] = out

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        n_input = output = -1
        ledger: _Ledger | None = request.state.get(self._state_key)
        matches: dict[Endpoint, PrefixCacheMatchInfo] | None = None
        for profile, res in result.profile_results.items():
            if res is None or not res.target_endpoints:
                continue
            if n_input < 0:
                n_input = estimate_input_tokens(request)
                output = (
                    estimate_output_tokens(request, n_input, self._ratio, self._output_cap)
                    if self._add_output
                    else 0
                )
                matches = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
            if ledger is None:
                ledger = request.state[self._state_key] = _Ledger(self)
            target = res.target_endpoints[0]
            info = matches.get(target) if matches else None
            tokens = uncached_input_tokens(n_input, info) + output  # output: from the full input
            counter = self._counter(target)
            counter.add(tokens)
            ledger.charges.append((counter, tokens, profile == PREFILL_PROFILE))
            self._outstanding += 1

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        ledger: _Ledger | None = request.state.get(self._state_key)
        if ledger is not None:
            ledger.release(prefill_only=True)
            if not self._add_output:
                ledger.release_tokens()

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        ledger: _Ledger | None = request.state.pop(self._state_key, None)
        if ledger is not None:
            ledger.release()

    # --- reads for other components -----------------------------------------------------------

    def load(self, key: str) -> InFlightLoad:
        """The in-flight load of endpoint ``key`` (zero when unknown), other replicas' included."""
        c = self._counters.get(key)
        local = c.load if c is not None else _ZERO
        p = self._peers.get(key)
        return local if p is None else InFlightLoad(local.tokens + p.tokens, local.requests + p.requests)

    def snapshot(self) -> dict[str, InFlightLoad]:
        """Every tracked endpoint's in-flight load, by endpoint key (other replicas' included)."""
        return {k: self.load(k) for k in {**self._counters, **self._peers}}

    # --- shared with the other replicas (a cross-replica syncer) --------------------------------

    def cross_replica_specs(self) -> list[SharedValue]:
        """``[requests, tokens]`` per endpoint, summed over the other replicas and added to ours."""
        return [
            SharedValue(
                state_key=f"{self.type_name}/{self.name}",
                supply=self._supply,
                aggregate=fold_sum,
                install=self._install_peers,
                valid=_valid_load,
            )
        ]

    def _supply(self) -> dict[str, list[int]]:
        return {k: [c.requests, c.tokens] for k, c in self._counters.items() if c.requests or c.tokens}

    def _install_peers(self, folded: Mapping[str, Any]) -> None:
        self._peers = {k: InFlightLoad(tokens=v[1], requests=v[0]) for k, v in folded.items() if v[0] or v[1]}

    # --- helpers ------------------------------------------------------------------------------

    def _counter(self, endpoint: Endpoint) -> _Counter:
        k = endpoint.metadata.key
        c = self._counters.get(k)
        if c is None:
            c = self._counters[k] = _Counter()
        return c

    def remove_endpoint(self, key: str) -> None:
        """Drop an endpoint's counters now (e.g. from a store ``on_remove`` listener)."""
        self._counters.pop(key, None)

    def _sweep(self, now: float) -> None:
        """Drop counters of endpoints that left the pool (when nobody calls ``remove_endpoint``)."""
        self._next_sweep = now + SWEEP_INTERVAL_SECONDS
        live = list(self._handle.endpoints()) if self._handle is not None else []
        if not live:
            return  # unknown (no handle, or an empty pool): keep the counters
        live_keys = {e.metadata.key for e in live}
        for k in [k for k in self._counters if k not in live_keys]:
            del self._counters[k]
