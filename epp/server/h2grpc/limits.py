"""What epp's HTTP/2 server allows a peer (streams, resets, frames that do no work, header blocks,
queued writes, stalled writes), and what happens when a peer goes beyond: a count per limit in
``llm_d_epp_extproc_h2_limit_total{limit}`` and one rate-limited log line per limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from epp import promlite
from epp.log_limit import LOGS

log = structlog.get_logger("epp.h2grpc")

LIMIT_TOTAL = promlite.Counter(
    "llm_d_epp_extproc_h2_limit_total",
    "Times a peer of the ext_proc port's HTTP/2 server (--extproc-server epp) went beyond one of its "
    "limits, per limit.",
    ["limit"],
)
promlite.register(LIMIT_TOTAL)

# The limit label values (a bounded set).
HEADER_BLOCK_BYTES = "header_block_bytes"
HEADER_BLOCK_FRAMES = "header_block_frames"
HPACK_TABLE_UPDATES = "hpack_table_updates"
RESETS = "resets"
IDLE_FRAMES = "idle_frames"
STREAMS = "streams_per_connection"
OPEN_CALLS = "open_calls"
WRITE_BUFFER = "write_buffer"
WRITE_STALL = "write_stall"
FLOW_CONTROL = "flow_control"
MALFORMED_HEADERS = "malformed_headers"
for _limit in (
    HEADER_BLOCK_BYTES,
    HEADER_BLOCK_FRAMES,
    HPACK_TABLE_UPDATES,
    RESETS,
    IDLE_FRAMES,
    STREAMS,
    OPEN_CALLS,
    WRITE_BUFFER,
    WRITE_STALL,
    FLOW_CONTROL,
    MALFORMED_HEADERS,
):
    LIMIT_TOTAL.labels(_limit)  # served at 0 before a peer first goes beyond it


@dataclass(slots=True, frozen=True)
class Limits:
    """The server's limits; ``0`` turns a budget or a timeout off."""

    max_concurrent_streams: int = 500  # per connection, advertised in SETTINGS; REFUSED_STREAM beyond
    max_open_calls: int = 10_000  # across connections; REFUSED_STREAM beyond
    max_header_block_bytes: int = 64 << 10  # HEADERS + CONTINUATION payload, also advertised
    max_header_block_frames: int = 16  # HEADERS + CONTINUATION frames of one block
    reset_burst: int = 1000  # streams the client resets before the server answered, then ...
    reset_rate: float = 100.0  # ... per second; GOAWAY(ENHANCE_YOUR_CALM) beyond
    idle_frame_burst: int = 1000  # frames that do no work (PING, SETTINGS, empty DATA, ...), then ...
    idle_frame_rate: float = 100.0  # ... per second; GOAWAY(ENHANCE_YOUR_CALM) beyond
    write_buffer_high: int = 1 << 20  # bytes queued to the socket above which reading pauses ...
    write_buffer_low: int = 256 << 10  # ... until they fall below this
    write_stall_timeout: float = (
        30.0  # a write waiting this long (window or socket) ends its stream/connection
    )

    def check(self) -> None:
        """ValueError naming the setting when one is out of range."""
        if not 1 <= self.max_concurrent_streams <= (1 << 31) - 1:
            raise ValueError(f"max_concurrent_streams={self.max_concurrent_streams}: must be 1 to 2^31-1")
        if self.max_open_calls < 1:
            raise ValueError(f"max_open_calls={self.max_open_calls}: must be at least 1")
        if self.max_header_block_bytes < 1024:
            raise ValueError(f"max_header_block_bytes={self.max_header_block_bytes}: must be at least 1024")
        if self.max_header_block_frames < 1:
            raise ValueError(f"max_header_block_frames={self.max_header_block_frames}: must be at least 1")
        for name in (
            "reset_burst",
            "reset_rate",
            "idle_frame_burst",
            "idle_frame_rate",
            "write_stall_timeout",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must not be negative")
        if not 0 < self.write_buffer_low <= self.write_buffer_high:
            raise ValueError(
                f"write_buffer_low={self.write_buffer_low}, write_buffer_high={self.write_buffer_high}: "
                "need 0 < low <= high"
            )


class Bucket:
    """A token bucket: ``burst`` events at once, refilled at ``rate`` per second; a burst of 0 has
    no limit."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, burst: int, rate: float, now: float) -> None:
        self.burst = burst
        self.rate = rate
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Count one event of ``cost`` tokens; False once the budget is spent."""
        if not self.burst:
            return True
        tokens = self.tokens + (now - self.stamp) * self.rate
        self.stamp = now
        if tokens > self.burst:
            tokens = self.burst
        if tokens < cost:
            self.tokens = tokens
            return False
        self.tokens = tokens - cost
        return True


def hit(limit: str, peer: str, message: str, **fields: Any) -> None:
    """A peer went beyond ``limit``: counted, and logged unless that limit logged lately."""
    LIMIT_TOTAL.labels(limit).value += 1
    LOGS.log(
        log.warning, f"h2_limit_{limit}", "HTTP/2 limit", limit=limit, error=message, peer=peer, **fields
    )
