"""structlog setup: the level and the output format (one JSON object per line, or console text).

The format is chosen by the caller, never by whether stderr is a terminal. Every log line goes to
stderr, so a command's standard output carries only its result. Also maps the reference EPP's zap
flags (``--zap-log-level``, ``--zap-encoder``, ``--v``) to these levels and formats. grpc's own
warnings and errors go through the stdlib root handler, rate-limited (cause ``grpc``).
"""

from __future__ import annotations

import logging
import sys

import structlog

from epp import log_limit

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}
FORMATS: tuple[str, ...] = ("json", "console")
# The reference's debug lines are logged at verbosity 4 (its V(1)-V(3) lines print as info).
_DEBUG_VERBOSITY = 4
_ZAP_NAMES: dict[str, str] = {"debug": "info", "info": "info", "warn": "warning", "error": "error"}
_configured_level = logging.INFO


def debug_enabled() -> bool:
    """Whether epp's own debug lines are logged (``--log-level=debug``): per-request explanations
    are only worked out then."""
    return _configured_level <= logging.DEBUG


def parse_level(text: str) -> str:
    """The canonical level name for ``text`` (case-insensitive); ValueError names the accepted ones."""
    name = text.strip().lower()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {text!r}: use debug, info, warning (or warn) or error")
    return "warning" if name == "warn" else name


def parse_format(text: str) -> str:
    name = text.strip().lower()
    if name not in FORMATS:
        raise ValueError(f"unknown log format {text!r}: use json or console")
    return name


def level_from_verbosity(verbosity: int) -> str:
    """The level matching the reference's ``--v``: debug from verbosity 4 on, info below it."""
    if verbosity < 0:
        raise ValueError(f"verbosity must be a non-negative integer, got {verbosity}")
    return "debug" if verbosity >= _DEBUG_VERBOSITY else "info"


def level_from_zap(text: str) -> str:
    """The level matching the reference's ``--zap-log-level``: a zap level name or a verbosity > 0.

    zap's ``debug`` is verbosity 1, whose lines the reference prints as info, hence info.
    """
    name = text.strip().lower()
    if name in _ZAP_NAMES:
        return _ZAP_NAMES[name]
    try:
        verbosity = int(name)
    except ValueError:
        verbosity = 0
    if verbosity <= 0:
        raise ValueError(
            f"unknown zap log level {text!r}: use debug, info, warn, error or a verbosity (integer > 0)"
        )
    return level_from_verbosity(verbosity)


class _Stderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured (a stream
    replaced later, e.g. by a test's capture, is followed; a closed one is never written to)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _Stderr()


def configure(level: str = "info", fmt: str = "json", third_party: str = "warning") -> None:
    """Log at ``level`` and above to stderr, rendered as ``fmt`` (``json`` or ``console``); the
    libraries' stdlib loggers (grpc, hpack, asyncio, ...) at ``third_party`` and above, but never below
    ``level``, so that epp's debug lines are not buried in theirs."""
    global _configured_level
    lvl = LEVELS[parse_level(level)]
    _configured_level = lvl
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if parse_format(fmt) == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
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
        logger_factory=structlog.PrintLoggerFactory(file=_STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=max(lvl, LEVELS[parse_level(third_party)]),
        stream=_STDERR,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    log_limit.limit_grpc_logging(logging.getLogger().handlers)
