"""``program-aware-fairness``: least attained service (LAS) between the programs of a band.

A program is a fairness id (one flow per band). Each completed response adds its weighted tokens to
the program's attained service, which decays with a half-life; the band's next dispatch goes to the
flow scoring best on low service and old head. Idle programs are forgotten after a TTL.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epp import promlite
from epp.framework import (
    BandView,
    Endpoint,
    FairnessPolicy,
    FlowView,
    Handle,
    LLMRequest,
    QueueItem,
    RequestDone,
    ResponseBodyProcessor,
    ResponseInfo,
    SchedulingResult,
    register,
)
from epp.framework.params import ensure_valid

STRATEGIES = ("las",)
INPUT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0  # an output token costs about twice an input token
_DISPATCHED = "program-aware-fairness/dispatched"  # request.state: its in-flight token
# A dispatched request whose end is never reported (it failed before it was routed) stops counting
# in flight after this long, or after evictionTtlSeconds when that is longer.
LOST_AFTER_SECONDS = 3600.0
_ACCOUNTED = "program-aware-fairness/accounted"  # request.state: service already added

JAINS_FAIRNESS_INDEX = promlite.Gauge(
    "llm_d_epp_program_aware_jains_fairness_index",
    "[ALPHA] Jain's fairness index over average wait time across active programs.",
)
AVG_WAIT_TIME_MS = promlite.Gauge(
    "llm_d_epp_program_aware_avg_wait_time_milliseconds",
    "[ALPHA] Cumulative mean of flow-control queue wait time per program in milliseconds.",
    ["program_id"],
)
ATTAINED_SERVICE_TOKENS = promlite.Gauge(
    "llm_d_epp_program_aware_attained_service_tokens",
    "[ALPHA] Time-decayed attained service (weighted tokens consumed) per program.",
    ["program_id"],
)
promlite.register(
    JAINS_FAIRNESS_INDEX, AVG_WAIT_TIME_MS, ATTAINED_SERVICE_TOKENS, owners=("program-aware-fairness",)
)


@dataclass(slots=True, frozen=True)
class ProgramAwareFairnessParams:
    strategy: str = "las"
    las_weight_service: float = 0.8
    las_weight_head_wait: float = 0.2
    las_half_life_seconds: float = 60.0
    eviction_ttl_seconds: float = 3600.0
    eviction_sweep_seconds: float = 300.0

    def validate(self) -> str | None:
        checks = (
            ("evictionTtlSeconds", self.eviction_ttl_seconds, ">=", self.eviction_ttl_seconds >= 0),
            ("evictionSweepSeconds", self.eviction_sweep_seconds, ">", self.eviction_sweep_seconds > 0),
            ("lasWeightService", self.las_weight_service, ">=", self.las_weight_service >= 0),
            ("lasWeightHeadWait", self.las_weight_head_wait, ">=", self.las_weight_head_wait >= 0),
            ("lasHalfLifeSeconds", self.las_half_life_seconds, ">=", self.las_half_life_seconds >= 0),
        )
        for key, value, op, ok in checks:
            if not ok or math.isinf(value):
                return f"{key}: {key} must be a finite number {op} 0, got {value:g}"
        if self.strategy not in STRATEGIES:
            return f'strategy: unknown scoring strategy {self.strategy!r}: only "las" is supported'
        return None


@dataclass(slots=True)
class _Program:
    """What the policy knows about one program."""

    last_completion: float  # or when the program was first seen
    service: float = 0.0  # weighted tokens, decay folded in up to ``anchor``
    anchor: float = -1.0  # when decay was last folded in (-1: never read)
    in_flight: int = 0
    dispatched: int = 0
    wait_count: int = 0
    avg_wait_ms: float = 0.0

    def decayed(self, now: float, half_life: float) -> float:
        """The service with decay up to ``now`` folded in (and the anchor moved to ``now``)."""
        if self.anchor < 0.0:
            self.anchor = now
            return self.service
        elapsed = now - self.anchor
        if elapsed > 0.0:
            if half_life > 0.0:
                self.service *= math.exp2(-elapsed / half_life)
            self.anchor = now
        return self.service


@register
class ProgramAwareFairness(FairnessPolicy, ResponseBodyProcessor, RequestDone):
    """Scores each non-empty flow ``wS·(1 - norm(service)) + wW·norm(head wait)`` (min-max
    normalised across the band; all equal: 0.5) and picks the best (ties: band order).

    Service comes from the usage of each finished response (``prompt + 2·completion`` tokens);
    queue waits are measured when an item is dispatched and feed the per-program mean and Jain's
    index. ``clock`` is the time source, ``time.monotonic`` (the scale of ``QueueItem`` times).
    """

    type_name = "program-aware-fairness"
    Params = ProgramAwareFairnessParams
    params: ProgramAwareFairnessParams

    def __init__(
        self, name: str, params: ProgramAwareFairnessParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else ProgramAwareFairnessParams()
        ensure_valid(params)
        super().__init__(name, params, handle)
        self.clock: Callable[[], float] = time.monotonic
        self._w_service = params.las_weight_service
        self._w_wait = params.las_weight_head_wait
        self._half_life = params.las_half_life_seconds
        self._ttl = params.eviction_ttl_seconds
        self._sweep_every = params.eviction_sweep_seconds
        self._lost_after = max(self._ttl, LOST_AFTER_SECONDS)
        self._next_sweep = -math.inf
        self._programs: dict[str, _Program] = {}
        self._open: dict[int, tuple[str, float]] = {}  # in-flight token -> (program, dispatched at)
        self._next_token = 0
        # Sums over programs with a wait observation, for Jain's index without a full pass.
        self._wait_sum = 0.0
        self._wait_sum_sq = 0.0
        self._wait_n = 0

    # --- fairness ---------------------------------------------------------------------------

    def pick(self, band: BandView) -> FlowView | None:
        now = self.clock()
        self._maybe_sweep(now)
        half_life = self._half_life
        scored: list[tuple[FlowView, float, float]] = []
        for flow in band.flows():
            service = self._program(flow.key.id, now).decayed(now, half_life)
            wait_ms = (now - flow.peek().enqueued_at) * 1000.0
            scored.append((flow, service, wait_ms))
        if len(scored) <= 1:
            return scored[0][0] if scored else None
        s_min = min(s for _, s, _ in scored)
        s_max = max(s for _, s, _ in scored)
        w_min = min(w for _, _, w in scored)
        w_max = max(w for _, _, w in scored)
        best: FlowView | None = None
        best_score = -math.inf
        for flow, service, wait_ms in scored:
            score = self._w_service * (1.0 - _normalise(service, s_min, s_max)) + self._w_wait * _normalise(
                wait_ms, w_min, w_max
            )
            if score > best_score:
                best, best_score = flow, score
        return best

    def dispatched(self, band: BandView, item: QueueItem) -> None:
        now = self.clock()
        program_id = item.key.id
        prog = self._program(program_id, now)
        prog.in_flight += 1
        prog.dispatched += 1
        token = self._next_token
        self._next_token = token + 1
        self._open[token] = (program_id, now)
        item.request.state[_DISPATCHED] = token
        wait_ms = max(0.0, (now - item.enqueued_at) * 1000.0)
        old = prog.avg_wait_ms
        if prog.wait_count:
            self._wait_sum -= old
            self._wait_sum_sq -= old * old
        else:
            self._wait_n += 1
        prog.wait_count += 1
        new = prog.avg_wait_ms = old + (wait_ms - old) / prog.wait_count
        self._wait_sum += new
        self._wait_sum_sq += new * new
        AVG_WAIT_TIME_MS.labels(program_id).set(new)
        JAINS_FAIRNESS_INDEX.set(self.fairness_index())

    # --- request lifecycle ------------------------------------------------------------------

    def response_body(
        self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None, chunk: bytes
    ) -> None:
        if not response.end_of_stream or _ACCOUNTED in request.state:
            return
        request.state[_ACCOUNTED] = True
        usage = response.usage or {}
        cost = INPUT_TOKEN_WEIGHT * _tokens(usage, "prompt_tokens") + OUTPUT_TOKEN_WEIGHT * _tokens(
            usage, "completion_tokens"
        )
        now = self.clock()
        program_id = request.fairness_id
        prog = self._program(program_id, now)
        prog.decayed(now, self._half_life)
        prog.service += cost
        prog.last_completion = now
        ATTAINED_SERVICE_TOKENS.labels(program_id).set(prog.service)

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        token = request.state.pop(_DISPATCHED, None)
        entry = self._open.pop(token, None) if isinstance(token, int) else None
        if entry is None:
            return
        now = self.clock()
        prog = self._programs.get(entry[0])
        if prog is not None:
            prog.in_flight = max(0, prog.in_flight - 1)
            prog.last_completion = now
        self._maybe_sweep(now)

    # --- state ------------------------------------------------------------------------------

    def attained_service(self, program_id: str) -> float:
        """The program's service with decay up to now (0 for an unknown program)."""
        prog = self._programs.get(program_id)
        return prog.decayed(self.clock(), self._half_life) if prog is not None else 0.0

    def programs(self) -> dict[str, dict[str, Any]]:
        """Per-program counters (for tests and debugging)."""
        return {
            pid: {
                "in_flight": p.in_flight,
                "dispatched": p.dispatched,
                "avg_wait_ms": p.avg_wait_ms,
                "wait_count": p.wait_count,
            }
            for pid, p in self._programs.items()
        }

    def fairness_index(self) -> float:
        """Jain's index over the programs' mean waits: 1.0 when fewer than two have waited."""
        n, total, total_sq = self._wait_n, self._wait_sum, self._wait_sum_sq
        if n <= 1 or total_sq <= 0.0:
            return 1.0
        return min(1.0, total * total / (n * total_sq))

    def _program(self, program_id: str, now: float) -> _Program:
        prog = self._programs.get(program_id)
        if prog is None:
            # A program seen but never completing still becomes evictable after the TTL.
            prog = self._programs[program_id] = _Program(last_completion=now)
        return prog

    def _maybe_sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        first = self._next_sweep == -math.inf  # the first sweep is one interval away
        self._next_sweep = now + self._sweep_every
        if not first:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Stop counting lost requests in flight, then evict idle programs (``evictionTtlSeconds`` > 0)."""
        lost_before = now - self._lost_after
        lost = [token for token, (_, at) in self._open.items() if at < lost_before]
        for token in lost:
            prog = self._programs.get(self._open.pop(token)[0])
            if prog is not None:
                prog.in_flight = max(0, prog.in_flight - 1)
        if self._ttl > 0.0:
            self._evict_idle(now)

    def _evict_idle(self, now: float) -> list[str]:
        """Forget programs with nothing in flight and no completion for ``evictionTtlSeconds``."""
        ttl = self._ttl
        gone = [
            pid for pid, p in self._programs.items() if p.in_flight == 0 and now - p.last_completion > ttl
        ]
        for pid in gone:
            del self._programs[pid]
            AVG_WAIT_TIME_MS.remove(pid)
            ATTAINED_SERVICE_TOKENS.remove(pid)
        # Recompute the sums exactly (drops the removed programs and any rounding drift).
        waits = [p.avg_wait_ms for p in self._programs.values() if p.wait_count]
        self._wait_n = len(waits)
        self._wait_sum = math.fsum(waits)
        self._wait_sum_sq = math.fsum(w * w for w in waits)
        if gone:
            JAINS_FAIRNESS_INDEX.set(self.fairness_index())
        return gone


def _normalise(value: float, lo: float, hi: float) -> float:
    return 0.5 if hi == lo else (value - lo) / (hi - lo)


def _tokens(usage: dict[str, Any], key: str) -> float:
    value = usage.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return 0.0
    return float(value)
