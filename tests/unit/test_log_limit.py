"""Client-triggerable log lines are rate-limited per cause and counted, over a real gRPC ext_proc server."""

from __future__ import annotations

import logging

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from epp.datalayer.store import EndpointStore
from epp.log_limit import (
    DEFAULT_BURST,
    EVENTS_TOTAL,
    LOGS,
    SUPPRESSED_TOTAL,
    GrpcLogFilter,
    LogLimiter,
)
from tests.unit.extproc_harness import body_msg, endpoint, headers_msg, start

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
N = 200


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limiter_logs_a_burst_per_cause_then_one_summary_per_window() -> None:
    clock = _Clock()
    limiter = LogLimiter(burst=3, interval=10.0, clock=clock)
    log = structlog.get_logger("test")
    with capture_logs() as logs:
        for _ in range(50):
            limiter.log(log.info, "unit_a", "event a")
        limiter.log(log.info, "unit_b", "event b")  # another cause has its own budget
        clock.now += 10.0
        limiter.log(log.info, "unit_a", "event a")
    events = [(e["event"], e.get("cause"), e.get("suppressed")) for e in logs]
    assert events == [
        *[("event a", "unit_a", None)] * 3,
        ("event b", "unit_b", None),
        ("log lines suppressed", "unit_a", 47),
        ("event a", "unit_a", None),
    ]
    assert EVENTS_TOTAL.labels("unit_a").value == 51
    assert SUPPRESSED_TOTAL.labels("unit_a").value == 47


def test_grpc_filter_limits_grpc_warnings_only() -> None:
    limiter = LogLimiter(burst=2, interval=10.0, clock=_Clock())
    f = GrpcLogFilter(limiter)

    def rec(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "msg", None, None)

    assert [f.filter(rec("grpc._cython.cygrpc", logging.ERROR)) for _ in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    assert f.filter(rec("grpc._server", logging.INFO))  # below WARNING: untouched
    assert f.filter(rec("epp.serve", logging.ERROR))  # not grpc: untouched


@pytest.fixture
async def harness():  # type: ignore[no-untyped-def]
    store = EndpointStore()
    store.upsert(endpoint(1))
    h = await start(store)
    yield h
    await h.channel.close()
    await h.server.stop(0)


async def test_malformed_frames_log_a_bounded_number_of_lines_and_count_all(harness) -> None:  # type: ignore[no-untyped-def]
    raw = harness.channel.stream_stream(
        METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    before = EVENTS_TOTAL.labels("malformed_frame").value
    with capture_logs() as logs:
        for _ in range(N):
            call = raw()
            await call.write(b"\xff\xff\xff\xff not a protobuf")
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert len(logs) <= DEFAULT_BURST + 1, len(logs)  # the burst, at most one summary
    assert all("exc_info" not in e for e in logs)  # a client's garbage is not our traceback
    assert EVENTS_TOTAL.labels("malformed_frame").value - before == N


async def test_rejected_requests_log_a_bounded_number_of_lines_and_count_all(harness) -> None:  # type: ignore[no-untyped-def]
    before = EVENTS_TOTAL.labels("rejected_400").value
    with capture_logs() as logs:
        for _ in range(N):
            replies = await harness.exchange([headers_msg({}), body_msg(b'{"messages": []}', True)], 1)
            assert replies[0].immediate_response.status.code == 400
    assert len(logs) <= DEFAULT_BURST + 1, len(logs)
    assert EVENTS_TOTAL.labels("rejected_400").value - before == N
    assert LOGS.burst == DEFAULT_BURST
