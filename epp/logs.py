"""structlog setup: human-readable on a terminal, one JSON object per line otherwise.

grpc's own warnings and errors go through the stdlib root handler, rate-limited (cause ``grpc``).
"""

from __future__ import annotations

import logging
import sys

import structlog

from epp import log_limit


def configure(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    log_limit.limit_grpc_logging(logging.getLogger().handlers)
