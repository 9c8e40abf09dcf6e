"""ext_proc stream hardening against the real ``epp serve``: a real gRPC client on its ext_proc port
(requests Envoy never sends: silent streams, a second ``end_of_stream``, a body after a header-only
request) and a real Envoy in front where the outcome reaches HTTP clients (the 503 of the body
budget, the 400 of a body that cannot be rewritten).

Every test checks on the EPP's ``/metrics`` that what a stream counted is released: the
running-requests gauge and each endpoint's in-flight count go back to 0.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prometheus_client.parser import text_string_to_metric_families

from epp.dev import stack
from tests.integration.harness import (
    MODEL,
    SIM_ARGS,
    Envoy,
    Epp,
    Response,
    Rig,
    Shared,
    Sim,
    chat_body,
    marker,
)
from tests.unit.extproc_harness import (
    BUFFERED,
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    trailers_msg,
)

pytestmark = pytest.mark.integration

IDLE_TIMEOUT = 1.0
MAX_BODY = 1 << 20
BUDGET = 1 << 20  # the smallest budget the EPP accepts: one largest body
WAIT = 30.0  # bound on every wait for the EPP (never a timing assertion)
# A slow model server: the response phase outlasts the idle timeout several times over.
SLOW_SIM_ARGS = (
    "--time-to-first-token",
    "1500",
    "--prefill-time-per-token",
    "0",
    "--inter-token-latency",
    "300",
    "--max-tokens",
    "8",
)


# ------------------------------------------------------------------------------------ metrics


def _samples(epp: Epp) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(epp.metrics()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(epp: Epp, name: str, **labels: str) -> float:
    return _samples(epp).get((name, tuple(sorted(labels.items()))), 0.0)


def _rejected(epp: Epp, reason: str) -> float:
    return _value(epp, "llm_d_epp_extproc_streams_rejected_total", reason=reason)


def _counts(epp: Epp) -> dict[str, float]:
    """What streams hold: running requests, in-flight per endpoint, open streams, buffered bytes."""
    held = {}
    for (name, labels), value in _samples(epp).items():
        if name in ("inference_objective_running_requests", "llm_d_epp_endpoint_inflight_requests"):
            held[f"{name}{dict(labels)}"] = value
        elif name in ("llm_d_epp_extproc_streams_inflight", "llm_d_epp_extproc_buffered_request_body_bytes"):
            held[name] = value
    return held


def _all_released(epp: Epp) -> None:
    """Bounded poll: every count a stream holds is back to 0 (the stream's end is asynchronous)."""
    last: dict[str, float] = {}

    def released() -> bool:
        nonlocal last
        last = _counts(epp)
        return "llm_d_epp_extproc_streams_inflight" in last and not any(last.values())

    try:
        stack.wait_until("stream counts released", released, timeout=WAIT, children=[epp.child])
    except TimeoutError:
        raise AssertionError(f"counts not released: { {k: v for k, v in last.items() if v} }") from None


def _wait_metric(epp: Epp, what: str, check: object) -> None:
    assert callable(check)
    stack.wait_until(what, check, timeout=WAIT, children=[epp.child])


# ------------------------------------------------------------------------------------- gRPC


@asynccontextmanager
async def _stub(epp: Epp) -> AsyncIterator[ep_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
        yield ep_grpc.ExternalProcessorStub(channel)


async def _read(call: grpc.aio.StreamStreamCall) -> ep.ProcessingResponse:
    r = await asyncio.wait_for(call.read(), WAIT)
    assert r is not grpc.aio.EOF, "the stream ended"
    assert isinstance(r, ep.ProcessingResponse)
    return r


async def _status(call: grpc.aio.StreamStreamCall) -> tuple[grpc.StatusCode, str]:
    """The stream's final status, reading (and dropping) whatever replies remain."""
    try:
        while await asyncio.wait_for(call.read(), WAIT) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    return await call.code(), await call.details() or ""


async def _routed(stub: ep_grpc.ExternalProcessorStub, body: bytes) -> grpc.aio.StreamStreamCall:
    """A FULL_DUPLEX stream whose request (headers, whole body) was routed: both replies read."""
    call = stub.Process()
    await call.write(headers_msg({}))
    await call.write(body_msg(body, True))
    kinds = [(await _read(call)).WhichOneof("response") for _ in range(2)]
    assert kinds == ["request_headers", "request_body"], kinds
    return call


def _big_chat(size: int) -> bytes:
    return chat_body("x" * size)


# ----------------------------------------------------------------------------------- fixtures


def _start_slow_sim(rig: Rig, name: str) -> Sim:
    sim = rig.add_sim(name, [*SIM_ARGS, *SLOW_SIM_ARGS])
    rig.stack.wait_sim(sim.child, sim.url)
    return sim


@dataclass
class Streams:
    idle: Epp  # --request-idle-timeout=1s, over one slow sim
    idle_envoy: Envoy
    budget: Epp  # 1 MiB bodies, 1 MiB budget, no idle timeout
    budget_envoy: Envoy


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Streams]:
    rig = Rig(Path(tmp_path_factory.mktemp("streams")) / "logs")
    try:
        slow = _start_slow_sim(rig, "slow-sim")
        sims = rig.start_sims(2)
        idle = rig.start_epp([slow], name="epp-idle", extra=[f"--request-idle-timeout={IDLE_TIMEOUT}s"])
        budget = rig.start_epp(
            sims,
            name="epp-budget",
            extra=[
                f"--max-request-body-bytes={MAX_BODY}",
                f"--max-buffered-request-body-bytes={BUDGET}",
                "--request-idle-timeout=0",
            ],
        )
        # The idle timeout and the body budget watch partial bodies: only a streamed body mode
        # (the reference's FULL_DUPLEX_STREAMED) shows one to the EPP; BUFFERED holds it in Envoy.
        full_duplex = "FULL_DUPLEX_STREAMED"
        yield Streams(
            idle,
            rig.start_envoy(idle, name="envoy-idle", body_mode=full_duplex),
            budget,
            rig.start_envoy(budget, name="envoy-budget", body_mode=full_duplex),
        )
    finally:
        rig.close()


# ------------------------------------------------------------------- item: the idle timeout


async def test_silent_streams_end_with_deadline_exceeded(streams: Streams) -> None:
    """Streams that sent their request headers (or part of the body) and went silent are closed."""
    epp = streams.idle
    before = _rejected(epp, "idle_timeout")
    async with _stub(epp) as stub:
        calls = []
        for i in range(200):
            call = stub.Process()
            await call.write(headers_msg({}))
            if i % 2:  # half of them with a partial body
                await call.write(body_msg(b'{"model": "demo", "messages": [', False))
            calls.append(call)
        statuses = await asyncio.wait_for(asyncio.gather(*(_status(c) for c in calls)), WAIT)
    assert {code for code, _ in statuses} == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert "request idle timeout" in statuses[0][1] and "--request-idle-timeout" in statuses[0][1]
    assert _rejected(epp, "idle_timeout") - before == 200
    _all_released(epp)


async def test_a_stream_that_never_sends_headers_is_closed(streams: Streams) -> None:
    async with _stub(streams.idle) as stub:
        call = stub.Process()
        code, _ = await asyncio.wait_for(_status(call), WAIT)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    _all_released(streams.idle)


async def test_a_body_that_keeps_coming_is_not_cut(streams: Streams) -> None:
    """The timeout counts from the last message: a slow upload with short gaps goes through."""
    epp = streams.idle
    before = _rejected(epp, "idle_timeout")
    body = chat_body(marker())
    pieces = [body[i : i + 8] for i in range(0, len(body), 8)]
    async with _stub(epp) as stub:
        call = stub.Process()
        await call.write(headers_msg({}))
        gap = IDLE_TIMEOUT / 4
        for piece in pieces[: int(3 * IDLE_TIMEOUT / gap)]:  # three timeouts long in all
            await call.write(body_msg(piece, False))
            await asyncio.sleep(gap)
        await call.write(body_msg(b"".join(pieces[int(3 * IDLE_TIMEOUT / gap) :]), True))
        assert (await _read(call)).WhichOneof("response") == "request_headers"
        await call.done_writing()
        code, details = await _status(call)
    assert code == grpc.StatusCode.OK, details
    assert _rejected(epp, "idle_timeout") == before
    _all_released(epp)


async def test_the_response_phase_is_never_timed(streams: Streams) -> None:
    """Once routed, a stream may stay silent far longer than the idle timeout."""
    epp = streams.idle
    async with _stub(epp) as stub:
        call = await _routed(stub, chat_body(marker()))
        await asyncio.sleep(3 * IDLE_TIMEOUT)
        await call.write(response_headers_msg({":status": "200", "content-type": "application/json"}))
        assert (await _read(call)).WhichOneof("response") == "response_headers"
        await asyncio.sleep(3 * IDLE_TIMEOUT)
        await call.write(response_body_msg(b'{"ok": true}', True))
        assert (await _read(call)).WhichOneof("response") == "response_body"
        await call.done_writing()
        code, details = await _status(call)
    assert code == grpc.StatusCode.OK, details
    _all_released(epp)


def test_a_slow_generation_through_envoy_is_not_cut(streams: Streams) -> None:
    """First token after 1.5 s, then one every 0.3 s: an SSE response longer than the idle timeout."""
    epp = streams.idle
    before = _rejected(epp, "idle_timeout")
    resp = streams.idle_envoy.post("/v1/chat/completions", chat_body(marker(), stream=True))
    assert resp.status == 200, resp
    events = [line for line in resp.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 8, resp.body[-300:]
    assert _rejected(epp, "idle_timeout") == before
    _all_released(epp)


# ------------------------------------------------------------------------ item: the budget


_OPEN_CHAT = b'{"model": "demo", "messages": ['


async def _hold(stub: ep_grpc.ExternalProcessorStub, size: int) -> grpc.aio.StreamStreamCall:
    """A stream holding ``size`` bytes of an unfinished body."""
    call = stub.Process()
    await call.write(headers_msg({}))
    await call.write(body_msg(_OPEN_CHAT + b" " * (size - len(_OPEN_CHAT)), False))
    return call


async def test_body_budget_answers_503_over_grpc(streams: Streams) -> None:
    epp = streams.budget
    before = _rejected(epp, "body_budget")
    async with _stub(epp) as stub:
        holder = await _hold(stub, 800_000)
        _wait_metric(
            epp,
            "800 kB buffered",
            lambda: _value(epp, "llm_d_epp_extproc_buffered_request_body_bytes") == 800_000,
        )
        over = await _hold(stub, 400_000)
        reply = await _read(over)
        assert reply.WhichOneof("response") == "immediate_response"
        assert reply.immediate_response.status.code == 503
        error = json.loads(reply.immediate_response.body)["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable"
        assert "--max-buffered-request-body-bytes" in error["message"]
        assert (await _status(over))[0] == grpc.StatusCode.OK
        # The refused stream released nothing it did not hold; the holder still completes.
        assert _value(epp, "llm_d_epp_extproc_buffered_request_body_bytes") == 800_000
        await holder.write(body_msg(b'{"role": "user", "content": "hi"}]}', True))
        assert (await _read(holder)).WhichOneof("response") == "request_headers"
        await holder.done_writing()
        assert (await _status(holder))[0] == grpc.StatusCode.OK
    assert _rejected(epp, "body_budget") - before == 1
    _all_released(epp)


def _post_unfinished(envoy: Envoy, chunk: bytes) -> Response:
    """POST a chunked body, send ``chunk`` but never the last chunk, and read the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=WAIT)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("transfer-encoding", "chunked")
        conn.endheaders()
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        resp = conn.getresponse()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


async def test_body_budget_answers_503_through_envoy(streams: Streams) -> None:
    """A client whose body would go over the budget gets a clear HTTP 503 at once."""
    epp = streams.budget
    async with _stub(epp) as stub:
        holder = await _hold(stub, 800_000)
        _wait_metric(
            epp,
            "800 kB buffered",
            lambda: _value(epp, "llm_d_epp_extproc_buffered_request_body_bytes") == 800_000,
        )
        chunk = _OPEN_CHAT + b" " * 400_000
        resp = await asyncio.to_thread(_post_unfinished, streams.budget_envoy, chunk)
        holder.cancel()
    assert resp.status == 503, resp
    assert resp.headers.get("retry-after") == "1"
    error = resp.json()["error"]
    assert error["code"] == 503 and "retry later" in error["message"]
    _all_released(epp)
    # With the budget free again, the same request goes through.
    ok = streams.budget_envoy.post("/v1/chat/completions", _big_chat(400_000))
    assert ok.status == 200, ok


# ------------------------------------------------------------ item: routed at most once


async def _protocol_error(call: grpc.aio.StreamStreamCall) -> str:
    code, details = await _status(call)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    return details


def _routed_once(epp: Epp, before: Mapping[str, float]) -> None:
    """Exactly one request was counted (total, duration), and nothing is left in flight."""
    _all_released(epp)
    after = _request_counters(epp)
    assert after["total"] - before["total"] == 1, (before, after)
    assert after["durations"] - before["durations"] == 1, (before, after)


def _request_counters(epp: Epp) -> dict[str, float]:
    samples = _samples(epp)
    return {
        "total": sum(v for (n, _), v in samples.items() if n == "inference_objective_request_total"),
        "durations": sum(
            v for (n, _), v in samples.items() if n == "inference_objective_request_duration_seconds_count"
        ),
    }


async def test_a_second_end_of_stream_is_a_protocol_error(streams: Streams) -> None:
    epp = streams.budget
    before, rejected = _request_counters(epp), _rejected(epp, "protocol_error")
    async with _stub(epp) as stub:
        call = await _routed(stub, chat_body(marker()))
        await call.write(body_msg(chat_body(marker()), True))
        details = await _protocol_error(call)
    assert "request_body" in details and "routed" in details
    assert _rejected(epp, "protocol_error") - rejected == 1
    _routed_once(epp, before)


async def test_a_body_after_a_header_only_request_is_a_protocol_error(streams: Streams) -> None:
    epp = streams.budget
    before = _request_counters(epp)
    async with _stub(epp) as stub:
        call = stub.Process()
        await call.write(headers_msg({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
        assert (await _read(call)).WhichOneof("response") == "request_headers"
        await call.write(body_msg(chat_body(marker()), True))
        await _protocol_error(call)
    _all_released(epp)
    # A header-only request is not a model request: not counted in the request total.
    assert _request_counters(epp) == before


def _late(kind: str) -> ep.ProcessingRequest:
    if kind == "headers":
        return headers_msg({})
    if kind == "body":
        return body_msg(chat_body(marker()), True)
    return trailers_msg()


@pytest.mark.parametrize(
    ("ended_by", "late"),
    [
        ("end_of_stream", "trailers"),
        ("end_of_stream", "headers"),
        ("trailers", "body"),
        ("trailers", "trailers"),
    ],
)
async def test_request_messages_after_the_request_ended(streams: Streams, ended_by: str, late: str) -> None:
    """The request ended (a body with end_of_stream, or trailers); then another request message."""
    epp = streams.budget
    before = _request_counters(epp)
    async with _stub(epp) as stub:
        call = stub.Process()
        await call.write(headers_msg({}))
        await call.write(body_msg(chat_body(marker()), False))
        await call.write(body_msg(b"", True) if ended_by == "end_of_stream" else trailers_msg())
        for _ in range(2 if ended_by == "end_of_stream" else 3):  # headers, body (, trailers) replies
            await _read(call)
        await call.write(_late(late))
        details = await _protocol_error(call)
    assert f"request_{late}" in details
    _routed_once(epp, before)


async def test_a_client_cancel_releases_the_counts(streams: Streams) -> None:
    epp = streams.budget
    before = _request_counters(epp)
    async with _stub(epp) as stub:
        call = await _routed(stub, chat_body(marker()))
        await call.write(response_headers_msg({":status": "200"}))
        await _read(call)
        call.cancel()
    _routed_once(epp, before)


async def test_buffered_body_followed_by_trailers(streams: Streams) -> None:
    """BUFFERED mode with request trailers: Envoy sends the whole body without end_of_stream."""
    epp = streams.budget
    before = _request_counters(epp)
    async with _stub(epp) as stub:
        call = stub.Process()
        await call.write(headers_msg({}, mode=BUFFERED, resp_mode=BUFFERED))
        assert (await _read(call)).WhichOneof("response") == "request_headers"
        await call.write(body_msg(chat_body(marker()), False))
        routing = await _read(call)
        assert routing.WhichOneof("response") == "request_body"
        assert routing.request_body.response.header_mutation.set_headers
        await call.write(trailers_msg())
        assert (await _read(call)).WhichOneof("response") == "request_trailers"
        await call.done_writing()
        assert (await _status(call))[0] == grpc.StatusCode.OK
    _routed_once(epp, before)


# ------------------------------------------------- item: bodies that cannot be rewritten


REWRITE = {"x-gateway-model-name-rewrite": MODEL}


def _error(resp: Response) -> dict[str, object]:
    data = resp.json()
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), resp.body
    error: dict[str, object] = data["error"]
    return error


_CHAT_ALIAS = b'{"model": "alias", "messages": [{"role": "user", "content": "hi"}]}'


def _deep(depth: int) -> bytes:
    return b'{"model": "alias", "messages": [{"role": "user", "content": "hi"}], "x": %s%s}' % (
        b"[" * depth,
        b"]" * depth,
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_deep(1000), None),  # within the parser's limit: routed, the model rewritten
        (_deep(5000), "depth limit exceeded"),
        (
            b'{"model": "alias", "messages": [{"role": "user", "content": "hi"}], "seed": 1%s}'
            % (b"0" * 400),
            "number",
        ),
        (b'{"model": "alias", "messages": [{"role": "user", "content": "hi\xff"}]}', "UTF-8"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', "invalid model in request body"),
        (b'["model", "alias"]', "must be a JSON object"),
        (b'{"model": "alias", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    ],
)
def test_bodies_with_a_model_rewrite(shared: Shared, body: bytes, message: str | None) -> None:
    for mode, envoy in shared.envoys.items():
        resp = envoy.post("/v1/chat/completions", body, REWRITE)
        if message is None:
            assert resp.status == 200, (mode, resp)
            continue
        assert resp.status == 400, (mode, resp)
        error = _error(resp)
        assert error["code"] == 400 and error["type"] == "invalid_request_error", (mode, error)
        assert message in str(error["message"]), (mode, error)
    _all_released(shared.epp)


def test_duplicate_model_keys_rewrite_the_one_that_counts(shared: Shared) -> None:
    """The last ``model`` wins (as in every JSON parser the model server may use): that one is rewritten."""
    m = marker()
    body = (
        b'{"model": "first", "messages": [{"role": "user", "content": "%s"}], "model": "alias"}' % m.encode()
    )
    for sim in shared.sims:
        sim.clear()
    resp = shared.envoys["FULL_DUPLEX_STREAMED"].post("/v1/chat/completions", body, REWRITE)
    assert resp.status == 200, resp
    entry = shared.sim_by_port(resp.port).find(m)
    assert entry is not None
    assert json.loads(entry["body"])["model"] == MODEL
    assert entry["body"].count('"model"') == 2  # every other byte kept
