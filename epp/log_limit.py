"""Rate limits for log lines that clients can trigger (rejected requests, malformed gRPC frames)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import structlog

from epp import promlite

DEFAULT_BURST = 5
DEFAULT_INTERVAL = 10.0

EVENTS_TOTAL = promlite.Counter(
    "llm_d_epp_client_log_events_total",
    "Client-triggerable log events (rejected requests, failed streams, malformed gRPC frames), per cause.",
    ["cause"],
)
SUPPRESSED_TOTAL = promlite.Counter(
    "llm_d_epp_client_log_events_suppressed_total",
    "Client-triggerable log events not logged because their cause exceeded its rate, per cause.",
    ["cause"],
)
promlite.register(EVENTS_TOTAL, SUPPRESSED_TOTAL)

_summary_log = structlog.get_logger("epp.log_limit")


class _Window:
    __slots__ = ("events", "logged", "start", "suppressed", "suppressed_total")

    def __init__(self, cause: str, now: float) -> None:
        self.start = now
        self.logged = 0
        self.suppressed = 0  # in the current window
        self.events = EVENTS_TOTAL.labels(cause)
        self.suppressed_total = SUPPRESSED_TOTAL.labels(cause)


class LogLimiter:
    """At most ``burst`` lines per cause per ``interval`` seconds, then one summary line.

    ``log(emit, cause, event, **fields)`` counts every event (and every dropped one) per cause; the
    first event of the next window is preceded by ``log lines suppressed``. Causes are a bounded set
    chosen by the call sites, never request data.
    """

    def __init__(
        self,
        burst: int = DEFAULT_BURST,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 0 or interval <= 0:
            raise ValueError("burst must be >= 0 and interval > 0")
        self.burst = burst
        self.interval = interval
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def allow(self, cause: str) -> bool:
        """Count one event of ``cause``; True when it may be logged."""
        now = self._clock()
        w = self._windows.get(cause)
        if w is None:
            w = self._windows[cause] = _Window(cause, now)
        w.events.value += 1
        if now - w.start >= self.interval:
            if w.suppressed:
                _summary_log.warning(
                    "log lines suppressed",
                    cause=cause,
                    suppressed=w.suppressed,
                    interval_s=self.interval,
                )
            w.start, w.logged, w.suppressed = now, 0, 0
        if w.logged < self.burst:
            w.logged += 1
            return True
        w.suppressed += 1
        w.suppressed_total.value += 1
        return False

    def log(self, emit: Callable[..., Any], cause: str, event: str, **fields: Any) -> None:
        """``emit(event, cause=cause, **fields)`` unless ``cause`` is over its rate."""
        if self.allow(cause):
            emit(event, cause=cause, **fields)


LOGS = LogLimiter()


class GrpcLogFilter(logging.Filter):
    """Rate-limits grpc's own warnings and errors (e.g. about failed streams) as cause ``grpc``."""

    def __init__(self, limiter: LogLimiter | None = None) -> None:
        super().__init__()
        self.limiter = limiter or LOGS

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith("grpc"):
            return True
        return self.limiter.allow("grpc")


def limit_grpc_logging(handlers: list[logging.Handler], limiter: LogLimiter | None = None) -> None:
    """Install one ``GrpcLogFilter`` on each of ``handlers`` (the root logger's)."""
    for handler in handlers:
        if not any(isinstance(f, GrpcLogFilter) for f in handler.filters):
            handler.addFilter(GrpcLogFilter(limiter))
