"""Envoy's reports of failed upstream attempts, received on the ext_proc port (passive health).

The generated bootstraps give the router an ``upstream_log`` that streams one gRPC access-log entry
per attempt that failed at the engine (a connect failure, a reset before headers, a 5xx) to
``envoy.service.accesslog.v3.AccessLogService``; successful attempts are not logged. Each entry is
handed to the plugins that listen (``UpstreamFailureListener``, e.g. ``endpoint-health-filter``).
Nothing here runs on the request path.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import structlog
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2

from epp import promlite
from epp.framework import UpstreamFailure, UpstreamFailureListener

log = structlog.get_logger("epp.server.upstream_failures")

_SERVICE = "envoy.service.accesslog.v3.AccessLogService"

REPORTS = promlite.Counter(
    "llm_d_epp_upstream_failure_reports_total",
    "Failed upstream attempts reported by Envoy's upstream access log, by failure.",
    ["failure"],
)
promlite.register(REPORTS)
for _failure in UpstreamFailure:
    REPORTS.labels(_failure.value)


def classify(entry: al.HTTPAccessLogEntry) -> tuple[str, UpstreamFailure] | None:
    """(engine ``ip:port``, failure) of one entry; None when it names no engine or no failure."""
    common = entry.common_properties
    address = common.upstream_remote_address.socket_address
    if not address.address or not address.port_value:
        return None
    host = f"[{address.address}]" if ":" in address.address else address.address
    hostport = f"{host}:{address.port_value}"
    flags = common.response_flags
    if flags.upstream_connection_failure or flags.upstream_retry_limit_exceeded:
        return hostport, UpstreamFailure.CONNECT
    if flags.upstream_connection_termination or flags.upstream_remote_reset or flags.local_reset:
        return hostport, UpstreamFailure.RESET
    if entry.response.response_code.value >= 500:
        return hostport, UpstreamFailure.SERVER_ERROR
    return None


class UpstreamFailureLog:
    """The AccessLogService servicer: entries to ``listeners``."""

    def __init__(self, listeners: Sequence[UpstreamFailureListener]) -> None:
        self.listeners = tuple(listeners)

    def report(self, entry: al.HTTPAccessLogEntry) -> None:
        found = classify(entry)
        if found is None:
            return
        hostport, failure = found
        REPORTS.labels(failure.value).inc()
        now = time.monotonic()
        for listener in self.listeners:
            try:
                listener.upstream_failed(hostport, failure, now)
            except Exception:
                log.exception("upstream failure listener failed", listener=repr(listener))

    async def StreamAccessLogs(
        self, requests: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in requests:
            for entry in message.http_logs.log_entry:
                self.report(entry)
        return als_pb2.StreamAccessLogsResponse()


def add_to_server(service: UpstreamFailureLog, server: Any) -> None:
    """Serve ``service`` (client streaming) on ``server`` (epp's gRPC server or grpc.aio)."""
    handlers = {
        "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
            service.StreamAccessLogs,
            request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
            response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(_SERVICE, handlers)
