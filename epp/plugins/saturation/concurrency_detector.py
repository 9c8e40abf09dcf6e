"""``concurrency-detector``: pool saturation from the requests and tokens this EPP has in flight.

Open loop: it counts what this replica routed and has not seen finish, never the servers' own
metrics, so it reacts at once to a burst but is blind to KV-cache pressure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from epp.framework import (
    CycleState,
    Endpoint,
    Filter,
    Handle,
    LLMRequest,
    SaturationDetector,
    register,
)
from epp.framework.attributes import DEFAULT_PRODUCERS, INFLIGHT_LOAD_KEY, InFlightLoad
from epp.framework.params import ensure_valid

log = structlog.get_logger("epp.plugins.concurrency_detector")

MODES = ("requests", "tokens", "hybrid")
DEFAULT_MAX_CONCURRENCY = 100
DEFAULT_MAX_TOKEN_CONCURRENCY = 1_000_000
_ZERO = InFlightLoad(tokens=0, requests=0)
_LoadFn = Callable[[Endpoint], InFlightLoad]


@dataclass(slots=True, frozen=True)
class ConcurrencyDetectorParams:
    concurrency_mode: str = "requests"
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_token_concurrency: int = DEFAULT_MAX_TOKEN_CONCURRENCY
    headroom: float = 0.0
    in_flight_load_producer_name: str = ""

    def validate(self) -> str | None:
        problems: list[tuple[str, str]] = []
        if self.max_concurrency <= 0:
            problems.append(
                ("maxConcurrency", f"maxConcurrency must be strictly positive, got {self.max_concurrency}")
            )
        if self.headroom < 0:
            problems.append(("headroom", f"headroom must be a non-negative value, got {self.headroom:g}"))
        if self.max_token_concurrency <= 0:
            problems.append(
                (
                    "maxTokenConcurrency",
                    f"maxTokenConcurrency must be strictly positive, got {self.max_token_concurrency}",
                )
            )
        if self.concurrency_mode not in MODES:
            problems.append(("concurrencyMode", f"unsupported concurrencyMode: {self.concurrency_mode!r}"))
        if not problems:
            return None
        reasons = "; ".join(reason for _, reason in problems)
        return f"{problems[0][0]}: invalid concurrency detector configuration: {reasons}"


class _LoadSource:
    """Finds the ``inflight-load-producer`` instance lazily (it may be created after this plugin)."""

    __slots__ = ("_handle", "_name", "_producer")

    def __init__(self, handle: Handle | None, name: str) -> None:
        self._handle = handle
        self._name = name
        self._producer: object | None = None

    def get(self) -> object | None:
        if self._producer is None and self._handle is not None:
            self._producer = self._handle.plugin(self._name)
        return self._producer


@register
class ConcurrencyDetector(SaturationDetector, Filter):
    """Reads the ``inflight-load-producer``'s per-endpoint requests and estimated tokens (the
    loader creates that producer when none is declared; without one, requests fall back to
    ``Endpoint.inflight`` and tokens to 0). As a filter it drops endpoints at or above
    ``capacity * (1 + headroom)``.
    """

    type_name = "concurrency-detector"
    Params = ConcurrencyDetectorParams
    params: ConcurrencyDetectorParams
    consumes = frozenset({INFLIGHT_LOAD_KEY})  # the loader creates the producer if none is declared

    def __init__(
        self, name: str, params: ConcurrencyDetectorParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else ConcurrencyDetectorParams()
        ensure_valid(params)
        super().__init__(name, params, handle)
        self._mode = params.concurrency_mode
        self._max_req = params.max_concurrency
        self._max_tok = params.max_token_concurrency
        self._req_limit = int(params.max_concurrency * (1.0 + params.headroom))
        self._tok_limit = int(params.max_token_concurrency * (1.0 + params.headroom))
        producer_name = params.in_flight_load_producer_name or DEFAULT_PRODUCERS[INFLIGHT_LOAD_KEY]
        self._loads = _LoadSource(handle, producer_name)
        self._reader: _LoadFn | None = None
        if params.headroom > 1.0:
            log.warning(
                "unusually high headroom configured; verify the value is a fraction, not a percentage",
                plugin=self.typed_name,
                headroom=params.headroom,
                effective_burst=f"{params.headroom * 100:.0f}%",
            )

    def _load_fn(self) -> _LoadFn:
        """How to read one endpoint's load: the producer's counters, or ``Endpoint.inflight``."""
        if self._reader is not None:
            return self._reader
        load = getattr(self._loads.get(), "load", None)
        if not callable(load):
            return _from_endpoint  # no producer (yet): looked up again next time

        def from_producer(e: Endpoint) -> InFlightLoad:
            value = load(e.metadata.key)
            return value if isinstance(value, InFlightLoad) else _ZERO

        self._reader = from_producer
        return from_producer

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        return self.dispatch_saturation(endpoints, 0)

    def dispatch_saturation(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        """Pending requests (released by flow control, not routed yet) count as in flight."""
        if not endpoints:
            return 1.0
        get = self._load_fn()
        max_req, max_tok = self._max_req, self._max_tok
        requests = tokens = 0
        hybrid = 0.0
        for e in endpoints:
            load = get(e)
            requests += load.requests
            tokens += load.tokens
            r, t = load.requests / max_req, load.tokens / max_tok
            hybrid += r if r > t else t
        n = len(endpoints)
        if self._mode == "tokens":
            return tokens / (max_tok * n)
        if self._mode == "hybrid":
            return (hybrid + pending / max_req) / n
        return (requests + pending) / (max_req * n)

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        get = self._load_fn()
        req_limit, tok_limit = self._req_limit, self._tok_limit
        mode = self._mode
        kept: list[Endpoint] = []
        for e in endpoints:
            load = get(e)
            if mode == "tokens":
                ok = load.tokens < tok_limit
            elif mode == "hybrid":
                ok = load.requests < req_limit and load.tokens < tok_limit
            else:
                ok = load.requests < req_limit
            if ok:
                kept.append(e)
        return kept


def _from_endpoint(e: Endpoint) -> InFlightLoad:
    return InFlightLoad(tokens=0, requests=e.inflight)
