"""``endpoint-health-filter``: keeps dead and failing engines out of scheduling (on by default).

Three kinds of evidence, cheapest first, checked per request in one pass over the candidates:

- ``down``: the last metrics scrape found no server (connection refused or reset), whatever the
  age of the metrics before it; back with the first good scrape.
- never scraped successfully: excluded while some candidate has metrics (a wrong port in an
  endpoints file, an engine still loading); when none has, every one is kept (a pool without a
  metrics source still serves).
- passive outlier detection: failed request attempts the data plane reports (Envoy's upstream
  access log: connect failures, resets before headers, 5xx) eject the endpoint for an exponential,
  capped back-off; one log line and a metric per transition.

The filter never leaves nothing: with every candidate excluded it keeps them all (a panic mode, as
Envoy's), so the request fails with the engine's own error rather than a scheduling one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter

import structlog

from epp import promlite
from epp.framework import (
    Endpoint,
    Handle,
    LLMRequest,
    Screener,
    UpstreamFailure,
    register,
)
from epp.framework.endpoint import SCRAPE_CONNECT_FAILURE

__all__ = ["EndpointHealthFilter", "EndpointHealthFilterParams", "OutlierDetector"]

log = structlog.get_logger("epp.plugins.endpoint_health_filter")

TYPE_NAME = "endpoint-health-filter"
_FAILURE = attrgetter("metrics.failure")
_UPDATE_TIME = attrgetter("metrics.update_time")

EJECTIONS = promlite.Counter(
    "llm_d_epp_endpoint_ejections_total",
    "Endpoints taken out of scheduling by passive health (failed request attempts), by failure.",
    ["reason"],
)
EJECTED = promlite.Gauge(
    "llm_d_epp_endpoints_ejected",
    "Endpoints currently out of scheduling by passive health.",
    [],
)
promlite.register(EJECTIONS)
promlite.register(EJECTED)
EJECTED.labels()  # served at 0 before the first ejection
for _failure in UpstreamFailure:
    EJECTIONS.labels(_failure.value)


@dataclass(slots=True, frozen=True)
class EndpointHealthFilterParams:
    """``connectFailures`` / ``serverErrors``: failed attempts of that kind, each within
    ``failureWindowMs`` of the previous one, that eject the endpoint (0: that kind never ejects).
    The n-th ejection in a row lasts ``baseEjectionMs * 2**(n-1)``, at most ``maxEjectionMs``."""

    exclude_down: bool = True
    exclude_never_scraped: bool = True
    connect_failures: int = 1
    server_errors: int = 5
    failure_window_ms: int = 10_000
    base_ejection_ms: int = 1_000
    max_ejection_ms: int = 30_000

    def validate(self) -> str | None:
        if self.connect_failures < 0 or self.server_errors < 0:
            return "connectFailures and serverErrors must be >= 0"
        if self.failure_window_ms <= 0:
            return f"failureWindowMs: must be > 0, got {self.failure_window_ms}"
        if not 0 < self.base_ejection_ms <= self.max_ejection_ms:
            return (
                "baseEjectionMs must be > 0 and not above maxEjectionMs, got "
                f"{self.base_ejection_ms} and {self.max_ejection_ms}"
            )
        return None


@dataclass(slots=True)
class _Outlier:
    """Passive-health state of one ``ip:port`` (kept only for endpoints that failed)."""

    failures: int = 0  # of ``kind``, each within the window of the previous one
    kind: UpstreamFailure = UpstreamFailure.CONNECT
    last_failure: float = 0.0
    ejections: int = 0  # in a row; the back-off doubles with each
    ejected_at: float = 0.0
    ejected_until: float = 0.0  # 0.0: not ejected


class OutlierDetector:
    """Counts failed attempts per ``ip:port`` and ejects with exponential, capped back-off.

    The data plane reports failures only (successes cost nothing), so "consecutive" means each
    failure came within ``window`` of the previous one. An ejection ends when its time is up; one
    for connect failures also ends at the first good metrics scrape after it (the engine is back).
    After ``max_ejection`` without a failure the back-off starts again from ``base``.
    """

    def __init__(self, params: EndpointHealthFilterParams) -> None:
        self._thresholds = {
            UpstreamFailure.CONNECT: params.connect_failures,
            UpstreamFailure.RESET: params.connect_failures,
            UpstreamFailure.SERVER_ERROR: params.server_errors,
        }
        self._window = params.failure_window_ms / 1000.0
        self._base = params.base_ejection_ms / 1000.0
        self._max = params.max_ejection_ms / 1000.0
        self._state: dict[str, _Outlier] = {}
        self.ejected: dict[str, _Outlier] = {}  # read per request: empty in a healthy pool

    def failed(self, hostport: str, failure: UpstreamFailure, now: float) -> bool:
        """Record one failed attempt; True when it ejected the endpoint."""
        state = self._state.get(hostport)
        if state is None:
            if len(self._state) >= 65536:  # bounded: reports name addresses, not store entries
                self._state.clear()
            state = self._state[hostport] = _Outlier()
        if now - state.last_failure > self._max and not state.ejected_until:
            state.ejections = 0  # healthy for a while: the back-off starts again
        kind = UpstreamFailure.CONNECT if failure is UpstreamFailure.RESET else failure
        if state.kind is not kind or now - state.last_failure > self._window:
            state.failures = 0
        state.kind = kind
        state.failures += 1
        state.last_failure = now
        threshold = self._thresholds[failure]
        if threshold == 0 or state.failures < threshold or state.ejected_until > now:
            return False
        state.failures = 0
        state.ejections += 1
        duration = min(self._base * 2 ** min(state.ejections - 1, 30), self._max)
        state.ejected_at = now
        state.ejected_until = now + duration
        self.ejected[hostport] = state
        EJECTIONS.labels(failure.value).inc()
        EJECTED.set(len(self.ejected))
        log.warning(
            "endpoint ejected", endpoint=hostport, failure=failure.value, ejection_s=round(duration, 3)
        )
        return True

    def is_ejected(self, endpoint: Endpoint, now: float) -> bool:
        """True while ``endpoint`` is ejected; lifts an ejection that ended (logged once)."""
        state = self.ejected.get(endpoint.metadata.hostport)
        if state is None:
            return False
        connect = state.kind is UpstreamFailure.CONNECT
        scraped_since = connect and endpoint.metrics.update_time > state.ejected_at
        if now < state.ejected_until and not scraped_since:
            return True
        self.release(endpoint.metadata.hostport, "scraped" if now < state.ejected_until else "back-off over")
        return False

    def release(self, hostport: str, why: str) -> None:
        state = self.ejected.pop(hostport, None)
        if state is None:
            return
        state.ejected_until = 0.0
        EJECTED.set(len(self.ejected))
        log.info("endpoint back in scheduling", endpoint=hostport, after=why)


@register
class EndpointHealthFilter(Screener):
    """A screener (so every profile sees the same healthy candidates) and an
    ``UpstreamFailureListener`` (the server feeds it Envoy's failure reports)."""

    type_name = TYPE_NAME
    Params = EndpointHealthFilterParams
    params: EndpointHealthFilterParams

    def __init__(
        self, name: str, params: EndpointHealthFilterParams | None = None, handle: Handle | None = None
    ) -> None:
        super().__init__(name, params or EndpointHealthFilterParams(), handle)
        self.detector = OutlierDetector(self.params)

    def upstream_failed(self, hostport: str, failure: UpstreamFailure, now: float) -> None:
        self.detector.failed(hostport, failure, now)

    bodyless = True

    def screen_bodyless(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        return self._healthy(endpoints)

    def screen(self, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return self._healthy(endpoints)

    def _healthy(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        p = self.params
        ejected = self.detector.ejected
        if not ejected and not (
            (p.exclude_down and SCRAPE_CONNECT_FAILURE in map(_FAILURE, endpoints))
            or (p.exclude_never_scraped and 0.0 in map(_UPDATE_TIME, endpoints))
        ):
            return endpoints  # the common case, checked in C: nothing down, ejected or unscraped
        now = time.monotonic() if ejected else 0.0
        dead = unscraped = 0
        for e in endpoints:  # something may be excluded: count what
            if (p.exclude_down and e.metrics.down) or (ejected and self.detector.is_ejected(e, now)):
                dead += 1
            elif p.exclude_never_scraped and e.metrics.update_time == 0.0:
                unscraped += 1
        if not dead and (not unscraped or unscraped == len(endpoints)):
            return endpoints
        alive = [
            e
            for e in endpoints
            if not ((p.exclude_down and e.metrics.down) or (ejected and self.detector.is_ejected(e, now)))
        ]
        if not alive:
            return endpoints  # everything is down: keep all (the engine's error reaches the client)
        scraped = [e for e in alive if e.metrics.update_time != 0.0] if unscraped else alive
        return scraped or alive
