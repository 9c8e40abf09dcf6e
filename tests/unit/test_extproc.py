"""The ext_proc stream state machine, driven over real gRPC like Envoy drives it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from epp.datalayer.store import EndpointStore
from epp.framework import CycleState, Endpoint, Filter, LLMRequest, PreRequest, SchedulingResult
from epp.server.director import DirectorHooks
from epp.server.extproc import BUFFERED, NONE, STREAMED, StreamOptions
from tests.unit import factories
from tests.unit.extproc_harness import (
    Harness,
    body_msg,
    destination_metadata,
    endpoint,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    set_headers,
    start,
    trailers_msg,
)

CHAT = b'{"model":"demo","messages":[{"role":"user","content":"hi"}],"seed":12345678901234567890123}'


@pytest.fixture
async def store() -> EndpointStore:
    s = EndpointStore()
    for i in (1, 2, 3):
        s.upsert(endpoint(i))
    return s


@pytest.fixture
async def harness(store: EndpointStore) -> AsyncIterator[Harness]:
    h = await start(store)
    yield h
    await h.channel.close()
    await h.server.stop(0)


def addresses(store: EndpointStore) -> set[str]:
    return {e.hostport for e in store.endpoints()}


async def test_full_duplex_chunked_body_routes_once_at_end_of_stream(
    harness: Harness, store: EndpointStore
) -> None:
    first, second = CHAT[:20], CHAT[20:]
    out = await harness.exchange([headers_msg({}), body_msg(first, False), body_msg(second, True)], expect=2)
    head, body = out
    assert head.WhichOneof("response") == "request_headers"
    common = head.request_headers.response
    assert common.clear_route_cache
    hdrs = set_headers(common)
    dest = hdrs["x-gateway-destination-endpoint"]
    assert dest in addresses(store)
    assert destination_metadata(head) == dest
    assert hdrs["content-length"] == str(len(CHAT))
    assert "x-request-id" in hdrs  # generated because the client sent none
    sr = body.request_body.response.body_mutation.streamed_response
    assert sr.body == CHAT  # forwarded byte for byte (the big seed keeps its digits)
    assert sr.end_of_stream


async def test_buffered_mode_answers_headers_then_routes_on_the_body_reply(harness: Harness) -> None:
    out = await harness.exchange([headers_msg({}, mode=BUFFERED), body_msg(CHAT, True)], expect=2)
    assert out[0].WhichOneof("response") == "request_headers"
    assert not out[0].request_headers.response.HasField("header_mutation")
    assert out[1].WhichOneof("response") == "request_body"
    common = out[1].request_body.response
    assert common.clear_route_cache
    assert set_headers(common)["x-gateway-destination-endpoint"] == destination_metadata(out[1])
    assert not common.HasField("body_mutation")  # body unchanged: nothing re-sent


async def test_header_only_request_goes_to_a_random_endpoint(harness: Harness, store: EndpointStore) -> None:
    seen = set()
    for _ in range(40):
        (reply,) = await harness.exchange(
            [headers_msg({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)], 1
        )
        seen.add(set_headers(reply.request_headers.response)["x-gateway-destination-endpoint"])
    assert seen == addresses(store)  # uniformly random: all three appear in 40 draws (p(miss) ~ 3e-7)


async def test_request_trailers_end_the_body(harness: Harness) -> None:
    out = await harness.exchange([headers_msg({}), body_msg(CHAT, False), trailers_msg()], expect=3)
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    sr = out[1].request_body.response.body_mutation.streamed_response
    assert sr.body == CHAT and not sr.end_of_stream  # trailers follow the body


async def test_large_body_is_resent_in_pieces_of_at_most_62000_bytes(harness: Harness) -> None:
    content = "x" * 150_000
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": content}]}).encode()
    chunks = [body[i : i + 16384] for i in range(0, len(body), 16384)]
    msgs = [headers_msg({})] + [body_msg(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
    out = await harness.exchange(msgs, expect=4)
    pieces = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert [len(p.body) <= 62000 for p in pieces] == [True] * 3
    assert b"".join(p.body for p in pieces) == body
    assert [p.end_of_stream for p in pieces] == [False, False, True]


@pytest.mark.parametrize(
    ("body", "path", "status", "text"),
    [
        (
            b"{not json",
            "/v1/chat/completions",
            400,
            "inference error: BadRequest - request body is not valid JSON",
        ),
        (
            b'{"messages":[{"role":"user","content":"hi"}]}',
            "/v1/chat/completions",
            400,
            "model not found in request body",
        ),
        (b'{"model":"demo"}', "/v1/completions", 400, "invalid completions request: must have prompt field"),
        (b'{"model":"demo","messages":[]}', "/v1/chat/completions", 400, "must have valid messages field"),
        (b"[1,2]", "/v1/completions", 400, "request body must be a JSON object, got an array"),
    ],
)
async def test_bad_bodies_get_openai_style_400(
    harness: Harness, body: bytes, path: str, status: int, text: str
) -> None:
    (reply,) = await harness.exchange([headers_msg({":path": path}), body_msg(body, True)], expect=1)
    ir = reply.immediate_response
    assert ir.status.code == status
    assert "retry-after" not in {h.header.key for h in ir.headers.set_headers}  # retrying will not help
    err = json.loads(ir.body)["error"]
    assert text in err["message"]
    assert err["code"] == status
    assert err["type"] == "invalid_request_error"  # OpenAI's type for a 400, not the Go code name
    assert {h.header.key: h.header.raw_value for h in ir.headers.set_headers}[
        "content-type"
    ] == b"application/json"


async def test_empty_pool_is_503_for_posts_and_gets() -> None:
    h = await start(EndpointStore())
    try:
        (r1,) = await h.exchange([headers_msg({}), body_msg(CHAT, True)], expect=1)
        (r2,) = await h.exchange([headers_msg({":method": "GET"}, end_of_stream=True)], expect=1)
    finally:
        await h.channel.close()
        await h.server.stop(0)
    assert r1.immediate_response.status.code == 503
    assert "failed to find endpoint candidates" in json.loads(r1.immediate_response.body)["error"]["message"]
    assert r2.immediate_response.status.code == 503
    assert json.loads(r1.immediate_response.body)["error"]["type"] == "service_unavailable"
    for reply in (r1, r2):
        sent = {h.header.key: h.header.raw_value for h in reply.immediate_response.headers.set_headers}
        assert sent["retry-after"] == b"1"


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        (["10.0.0.2:8000"], {"10.0.0.2:8000"}),
        ("10.0.0.1:8000,10.0.0.3:8000", {"10.0.0.1:8000", "10.0.0.3:8000"}),
        (["10.0.0.3"], {"10.0.0.3:8000"}),  # a bare IP matches every port of that host
    ],
)
async def test_subset_hint_confines_routing(harness: Harness, subset: object, expected: set[str]) -> None:
    seen = set()
    for _ in range(30):
        out = await harness.exchange([headers_msg({}, subset=subset), body_msg(CHAT, True)], expect=2)
        seen.add(set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"])
    assert seen == expected


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:8000"], ["10.0.0.1:9999"]])
async def test_subset_hint_without_a_match_is_503(harness: Harness, subset: object) -> None:
    (reply,) = await harness.exchange([headers_msg({}, subset=subset), body_msg(CHAT, True)], expect=1)
    assert reply.immediate_response.status.code == 503


async def test_client_control_headers_are_removed_or_overwritten(
    harness: Harness, store: EndpointStore
) -> None:
    spoof = {
        "x-gateway-destination-endpoint": "6.6.6.6:80",
        "x-prefiller-host-port": "6.6.6.6:80",
        "x-encoder-hosts-ports": "6.6.6.6:80",
        "x-request-id": "req-1",
    }
    out = await harness.exchange([headers_msg(spoof), body_msg(CHAT, True)], expect=2)
    common = out[0].request_headers.response
    hdrs = set_headers(common)
    assert hdrs["x-gateway-destination-endpoint"] in addresses(store)
    assert {"x-prefiller-host-port", "x-encoder-hosts-ports"} <= set(common.header_mutation.remove_headers)
    assert "x-request-id" not in hdrs  # the client's id is kept as is


async def test_model_rewrite_header_rewrites_body_and_response(harness: Harness) -> None:
    body = b'{"model": "demo", "prompt": "hi", "seed": 18446744073709551617}'
    msgs = [
        headers_msg({":path": "/v1/completions", "x-gateway-model-name-rewrite": "demo-lora"}),
        body_msg(body, True),
        response_headers_msg({":status": "200", "content-type": "application/json", "content-length": "40"}),
        response_body_msg(b'{"id":"1","model":"demo-lora",', False),
        response_body_msg(b'"choices":[]}', True),
    ]
    out = await harness.exchange(msgs, expect=4)
    common = out[0].request_headers.response
    sent = out[1].request_body.response.body_mutation.streamed_response.body
    assert sent == b'{"model": "demo-lora", "prompt": "hi", "seed": 18446744073709551617}'
    assert set_headers(common)["content-length"] == str(len(sent))
    assert "x-gateway-model-name-rewrite" in common.header_mutation.remove_headers
    resp_headers = out[2].response_headers.response
    assert set_headers(resp_headers)["x-went-into-resp-headers"] == "true"
    assert "content-length" in resp_headers.header_mutation.remove_headers
    final = out[3].response_body.response.body_mutation.streamed_response
    assert final.body == b'{"id":"1","model":"demo","choices":[]}' and final.end_of_stream


async def test_streaming_response_chunks_pass_through_immediately(harness: Harness) -> None:
    stream_body = b'{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    call = harness.stub.Process()
    for m in (headers_msg({}), body_msg(stream_body, True)):
        await call.write(m)
    assert (await call.read()).WhichOneof("response") == "request_headers"
    assert (await call.read()).WhichOneof("response") == "request_body"
    await call.write(response_headers_msg({":status": "200", "content-type": "text/event-stream"}))
    assert (await call.read()).WhichOneof("response") == "response_headers"
    await call.write(response_body_msg(b"data: {}\n\n", False))
    chunk = (await call.read()).response_body.response.body_mutation.streamed_response
    assert chunk.body == b"data: {}\n\n" and not chunk.end_of_stream  # echoed before the stream ends
    await call.write(response_body_msg(b"data: [DONE]\n\n", True))
    last = (await call.read()).response_body.response.body_mutation.streamed_response
    assert last.end_of_stream
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def _answered_at_once(call: grpc.aio.StreamStreamCall, chunk: bytes) -> ProcessingResponse:
    """Send one response-body chunk (not the last) and read its reply: a body held back until its
    end would leave the read waiting, so the timeout here fails the test instead of hanging it."""
    await call.write(response_body_msg(chunk, False))
    return await asyncio.wait_for(call.read(), 5.0)


async def test_stream_chunks_pass_through_when_envoy_skips_the_response_headers(harness: Harness) -> None:
    # response_header_mode SKIP with FULL_DUPLEX_STREAMED response bodies: no response headers
    # tell the EPP that the body is an event stream; the request does. The first token must reach
    # the client before the second is generated, not with the whole stream at its end.
    stream_body = b'{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    call = harness.stub.Process()
    for m in (headers_msg({}), body_msg(stream_body, True)):
        await call.write(m)
    assert (await call.read()).WhichOneof("response") == "request_headers"
    assert (await call.read()).WhichOneof("response") == "request_body"
    for token in (b'data: {"n":1}\n\n', b'data: {"n":2}\n\n'):
        piece = (await _answered_at_once(call, token)).response_body.response.body_mutation
        assert piece.streamed_response.body == token and not piece.streamed_response.end_of_stream
    await call.write(response_body_msg(b"data: [DONE]\n\n", True))
    last = (await call.read()).response_body.response.body_mutation.streamed_response
    assert last.body == b"data: [DONE]\n\n" and last.end_of_stream
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_a_non_streamed_body_the_epp_does_not_rewrite_is_not_held(harness: Harness) -> None:
    call = harness.stub.Process()
    for m in (headers_msg({}), body_msg(CHAT, True)):
        await call.write(m)
    assert (await call.read()).WhichOneof("response") == "request_headers"
    assert (await call.read()).WhichOneof("response") == "request_body"
    await call.write(response_headers_msg({":status": "200", "content-type": "application/json"}))
    assert (await call.read()).WhichOneof("response") == "response_headers"
    first = (await _answered_at_once(call, b'{"id":"1",')).response_body.response.body_mutation
    assert first.streamed_response.body == b'{"id":"1",' and not first.streamed_response.end_of_stream
    await call.write(response_body_msg(b'"choices":[]}', True))
    last = (await call.read()).response_body.response.body_mutation.streamed_response
    assert last.body == b'"choices":[]}' and last.end_of_stream
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_in_flight_count_is_released_when_the_stream_ends(
    harness: Harness, store: EndpointStore
) -> None:
    call = harness.stub.Process()
    await call.write(headers_msg({}))
    await call.write(body_msg(CHAT, True))
    head = await call.read()
    dest = set_headers(head.request_headers.response)["x-gateway-destination-endpoint"]
    ep = next(e for e in store.endpoints() if e.hostport == dest)
    assert ep.inflight == 1
    call.cancel()  # Envoy resets the stream (client went away)
    for _ in range(200):
        if ep.inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert ep.inflight == 0


async def test_a_broken_stream_does_not_disturb_another(harness: Harness) -> None:
    broken = harness.stub.Process()
    await broken.write(headers_msg({}))
    await broken.write(body_msg(CHAT[:10], False))
    broken.cancel()
    out = await harness.exchange([headers_msg({}), body_msg(CHAT, True)], expect=2)
    assert out[0].WhichOneof("response") == "request_headers"


async def test_body_over_the_limit_is_413(store: EndpointStore) -> None:
    h = await start(store, opts=StreamOptions(max_body_bytes=1000))
    try:
        (reply,) = await h.exchange([headers_msg({}), body_msg(b"{" + b" " * 2000, False)], expect=1)
    finally:
        await h.channel.close()
        await h.server.stop(0)
    assert reply.immediate_response.status.code == 413


class _RejectAll(Filter):
    type_name = "reject-all"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return []


async def test_scheduling_failure_is_429(store: EndpointStore) -> None:
    h = await start(store, director=factories.director(store, filters=[_RejectAll("reject-all", None)]))
    try:
        (reply,) = await h.exchange([headers_msg({}), body_msg(CHAT, True)], expect=1)
    finally:
        await h.channel.close()
        await h.server.stop(0)
    assert reply.immediate_response.status.code == 429
    message = json.loads(reply.immediate_response.body)["error"]["message"]
    # filters that drain the candidates answer as the reference (#2462): the filter's error, saturated
    expected = "no endpoints available for the given request (filter 'reject-all')"
    assert message == f"inference error: ResourceExhausted - {expected}"
    sent = {h.header.key: h.header.raw_value for h in reply.immediate_response.headers.set_headers}
    assert sent["x-llm-d-request-dropped-reason"] == b"rejected-saturated"
    assert sent["retry-after"] == b"1"  # a 429 says when to come back


async def test_body_mode_none_routes_on_headers(harness: Harness, store: EndpointStore) -> None:
    (reply,) = await harness.exchange([headers_msg({}, mode=NONE)], expect=1)
    assert set_headers(reply.request_headers.response)["x-gateway-destination-endpoint"] in addresses(store)


class _SetPrefill(PreRequest):
    type_name = "set-prefill"

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        request.headers["x-prefiller-host-port"] = "10.0.0.9:8000"


async def test_plugin_set_control_header_is_forwarded_even_when_the_client_sent_the_same_value(
    store: EndpointStore,
) -> None:
    director = factories.director(store)
    director.hooks = DirectorHooks(pre_request=[_SetPrefill("set-prefill", None)])
    h = await start(store, director=director)
    try:
        out = await h.exchange(
            [headers_msg({"x-prefiller-host-port": "10.0.0.9:8000"}), body_msg(CHAT, True)], expect=2
        )
    finally:
        await h.channel.close()
        await h.server.stop(0)
    common = out[0].request_headers.response
    assert set_headers(common)["x-prefiller-host-port"] == "10.0.0.9:8000"
    assert "x-prefiller-host-port" not in common.header_mutation.remove_headers


async def test_streaming_response_model_is_rewritten_back_per_chunk(harness: Harness) -> None:
    body = b'{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    msgs = [
        headers_msg({"x-gateway-model-name-rewrite": "demo-lora"}),
        body_msg(body, True),
        response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
        response_body_msg(b'data: {"model":"demo-lora","x":1}\n\n', False),
        response_body_msg(b'data: {"model": "demo-lora"}\n\ndata: [DONE]\n\n', True),
    ]
    out = await harness.exchange(msgs, expect=5)
    chunks = [r.response_body.response.body_mutation.streamed_response.body for r in out[3:]]
    assert chunks == [b'data: {"model":"demo","x":1}\n\n', b'data: {"model": "demo"}\n\ndata: [DONE]\n\n']


# --- phases, idle timeout, body budget ------------------------------------------------------


async def _final_status(call: grpc.aio.StreamStreamCall) -> grpc.StatusCode:
    try:
        while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    code: grpc.StatusCode = await call.code()
    return code


async def test_a_second_end_of_stream_routes_nothing(harness: Harness, store: EndpointStore) -> None:
    call = harness.stub.Process()
    await call.write(headers_msg({}))
    await call.write(body_msg(CHAT, True))
    for _ in range(2):
        await call.read()
    assert sum(e.inflight for e in store.endpoints()) == 1
    await call.write(body_msg(CHAT, True))
    assert await _final_status(call) == grpc.StatusCode.FAILED_PRECONDITION
    for _ in range(50):  # the handler's finally runs after the status is sent
        if sum(e.inflight for e in store.endpoints()) == 0:
            break
        await asyncio.sleep(0.02)
    assert [e.inflight for e in store.endpoints()] == [0, 0, 0]


async def test_idle_sweeper_cuts_silent_streams_and_then_stops(store: EndpointStore) -> None:
    h = await start(store, opts=StreamOptions(request_idle_timeout=0.2))
    limits = h.processor.limits
    try:
        calls = [h.stub.Process() for _ in range(5)]
        for call in calls:
            await call.write(headers_msg({}))
        codes = await asyncio.gather(*(_final_status(c) for c in calls))
        assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
        for _ in range(100):  # no stream waits: the sweeper task ends (no idle wake-ups)
            if limits.watched == 0 and limits.sweeping is False:
                break
            await asyncio.sleep(0.02)
        assert limits.watched == 0 and not limits.sweeping
        # A routed stream is not watched, however long it stays silent.
        call = h.stub.Process()
        await call.write(headers_msg({}))
        await call.write(body_msg(CHAT, True))
        for _ in range(2):
            await call.read()
        await asyncio.sleep(0.6)
        await call.write(response_headers_msg({":status": "200"}))
        assert (await call.read()).WhichOneof("response") == "response_headers"
        await call.done_writing()
        assert await _final_status(call) == grpc.StatusCode.OK
    finally:
        await h.channel.close()
        await h.server.stop(0)
        await h.processor.close()


async def test_budget_counts_only_bodies_waiting_for_more(store: EndpointStore) -> None:
    h = await start(store, opts=StreamOptions(max_body_bytes=1000, max_buffered_body_bytes=1000))
    limits = h.processor.limits
    try:
        holder = h.stub.Process()
        await holder.write(headers_msg({}))
        await holder.write(body_msg(b"x" * 600, False))
        for _ in range(100):
            if limits.buffered == 600:
                break
            await asyncio.sleep(0.01)
        assert limits.buffered == 600
        # A whole body is routed at once: never refused by the budget.
        out = await h.exchange([headers_msg({}), body_msg(CHAT, True)], expect=2)
        assert out[0].WhichOneof("response") == "request_headers"
        refused = h.stub.Process()
        await refused.write(headers_msg({}))
        await refused.write(body_msg(b"y" * 500, False))
        reply = await refused.read()
        assert reply.immediate_response.status.code == 503
        assert await _final_status(refused) == grpc.StatusCode.OK
        holder.cancel()
        for _ in range(100):
            if limits.buffered == 0:
                break
            await asyncio.sleep(0.01)
        assert limits.buffered == 0
    finally:
        await h.channel.close()
        await h.server.stop(0)


def _streamed_headers() -> object:
    msg = headers_msg({}, mode=STREAMED)
    msg.protocol_config.send_body_without_waiting_for_header_response = True  # type: ignore[attr-defined]
    return msg


async def test_streamed_mode_routes_in_the_delayed_headers_reply_then_answers_each_chunk(
    harness: Harness, store: EndpointStore
) -> None:
    first, second = CHAT[:20], CHAT[20:]
    msgs = [_streamed_headers(), body_msg(first, False), body_msg(second, True)]
    out = await harness.exchange(msgs, expect=3)  # type: ignore[arg-type]
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_body"]
    common = out[0].request_headers.response
    assert common.clear_route_cache
    hdrs = set_headers(common)
    assert hdrs["x-gateway-destination-endpoint"] in addresses(store)
    assert "content-length" not in hdrs  # the body goes on unchanged
    for reply in out[1:]:  # nothing echoed back
        assert not reply.request_body.response.HasField("body_mutation")


async def test_streamed_mode_request_trailers_end_the_body(harness: Harness) -> None:
    msgs = [_streamed_headers(), body_msg(CHAT, False), trailers_msg()]
    out = await harness.exchange(msgs, expect=3)  # type: ignore[arg-type]
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]


async def test_streamed_mode_needs_the_body_before_the_headers_reply(harness: Harness) -> None:
    (reply,) = await harness.exchange([headers_msg({}, mode=STREAMED), body_msg(CHAT, True)], expect=1)
    assert reply.WhichOneof("response") == "immediate_response"
    assert b"send_body_without_waiting_for_header_response" in reply.immediate_response.body


async def test_streamed_mode_rewrite_replaces_the_first_chunk_and_clears_the_others(harness: Harness) -> None:
    body = b'{"model": "demo", "prompt": "hi", "seed": 18446744073709551617}'
    head = headers_msg(
        {":path": "/v1/completions", "x-gateway-model-name-rewrite": "demo-lora"}, mode=STREAMED
    )
    head.protocol_config.send_body_without_waiting_for_header_response = True
    out = await harness.exchange([head, body_msg(body[:10], False), body_msg(body[10:], True)], expect=3)
    common = out[0].request_headers.response
    first, rest = out[1].request_body.response.body_mutation, out[2].request_body.response.body_mutation
    assert first.body == b'{"model": "demo-lora", "prompt": "hi", "seed": 18446744073709551617}'
    assert rest.clear_body
    assert set_headers(common)["content-length"] == str(len(first.body))


async def test_skip_unused_response_phases_turns_them_off_in_the_buffered_headers_reply(
    store: EndpointStore,
) -> None:
    h = await start(store, opts=StreamOptions(skip_unused_response_phases=True))
    try:
        out = await h.exchange([headers_msg({}, mode=BUFFERED), body_msg(CHAT, True)], expect=2)
        override = out[0].mode_override
        assert override.response_header_mode == override.SKIP
        assert override.response_body_mode == override.NONE
        assert override.response_trailer_mode == override.SEND  # the stream lasts to the response end
        assert override.request_body_mode == BUFFERED
        # A model-rewritten request keeps its response phases (the response names the asked model).
        rewritten = headers_msg({"x-gateway-model-name-rewrite": "demo-lora"}, mode=BUFFERED)
        out = await h.exchange([rewritten, body_msg(CHAT, True)], expect=2)
        assert not out[0].HasField("mode_override")
    finally:
        await h.channel.close()
        await h.server.stop(0)


async def test_response_phases_stay_when_a_plugin_reads_the_response(store: EndpointStore) -> None:
    class Reader:
        def response_header(self, *args: object) -> None:
            pass

    opts = StreamOptions(response_header=(Reader(),), skip_unused_response_phases=True)  # type: ignore[arg-type]
    assert not opts.skip_unused_response_phases
    assert not StreamOptions().skip_unused_response_phases  # opt-in
