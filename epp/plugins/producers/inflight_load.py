"""``inflight-load-producer``: requests and estimated tokens this EPP has in flight per endpoint."""

from __future__ import annotations

import time
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
from epp.framework.attributes import INFLIGHT_LOAD_KEY, InFlightLoad

__all__ = ["InFlightLoadProducer", "estimate_tokens"]

PREFILL_PROFILE = "prefill"
SWEEP_INTERVAL_SECONDS = 30.0
_ZERO = InFlightLoad(tokens=0, requests=0)


def _round_half_up(x: float) -> int:
    """Go's ``math.Round`` for x >= 0 (Python's ``round`` rounds half to even)."""
    return int(x + 0.5)


def estimate_tokens(request: LLMRequest) -> int:
    """Input estimate plus 1.5x for the output: ``input + round(1.5 * input)``."""
    if request.request_size_bytes > 0:
        n_input = request.request_size_bytes // 4
    else:
        n_input = _round_half_up(len(request.body.prompt_text) / 4)
    return n_input + _round_half_up(1.5 * n_input)


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

    def __del__(self) -> None:
        # the request object went away without request_done: give its charges back
        if self.charges:
            try:
                self.release()
            except Exception:  # never raise from a finaliser (e.g. at interpreter shutdown)
                pass


@register
class InFlightLoadProducer(DataProducer, PreRequest, ResponseHeaderProcessor, RequestDone):
    """PreRequest charges every picked profile's first target; releases come at response headers
    (the ``prefill`` charge) and in ``request_done`` (everything else).

    A charge remembers the counter it incremented and is released once, also when the request
    object is collected without ``request_done``; counters never go below 0. Counters of endpoints
    that left the pool are dropped (``remove_endpoint``, or a lazy check every 30 s).
    """

    type_name = "inflight-load-producer"
    produces = frozenset({INFLIGHT_LOAD_KEY})

    def __init__(self, name: str, params: Any = None, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._handle = handle
        self._counters: dict[str, _Counter] = {}
        self._outstanding = 0  # unreleased charges; 0 means every counter is 0
        self._state_key = f"{self.type_name}/{name}"
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_SECONDS

    # --- request path -------------------------------------------------------------------------

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        if self._outstanding <= 0:
            cycle[INFLIGHT_LOAD_KEY] = dict.fromkeys(endpoints, _ZERO)
            return
        counters = self._counters
        out: dict[Endpoint, InFlightLoad] = {}
        for e in endpoints:
            c = counters.get(e.metadata.key)
            out[e] = c.load if c is not None else _ZERO
        cycle[INFLIGHT_LOAD_KEY] = out

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        tokens = -1
        ledger: _Ledger | None = request.state.get(self._state_key)
        for profile, res in result.profile_results.items():
            if res is None or not res.target_endpoints:
                continue
            if tokens < 0:
                tokens = estimate_tokens(request)
            if ledger is None:
                ledger = request.state[self._state_key] = _Ledger(self)
            counter = self._counter(res.target_endpoints[0])
            counter.add(tokens)
            ledger.charges.append((counter, tokens, profile == PREFILL_PROFILE))
            self._outstanding += 1

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        ledger: _Ledger | None = request.state.get(self._state_key)
        if ledger is not None:
            ledger.release(prefill_only=True)

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        ledger: _Ledger | None = request.state.pop(self._state_key, None)
        if ledger is not None:
            ledger.release()

    # --- reads for other components -----------------------------------------------------------

    def load(self, key: str) -> InFlightLoad:
        """The in-flight load of endpoint ``key`` (zero when unknown)."""
        c = self._counters.get(key)
        return c.load if c is not None else _ZERO

    def snapshot(self) -> dict[str, InFlightLoad]:
        """Every tracked endpoint's in-flight load, by endpoint key."""
        return {k: c.load for k, c in self._counters.items()}

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
