"""The response side of the ext_proc stream: undoing a model rewrite in each exchange the bootstraps use.

* BUFFERED request bodies: the response-headers reply asks for the body (mode override), then the
  body is rewritten as a full-duplex stream;
* FULL_DUPLEX_STREAMED with no response body: the routing stream leaves the response alone; a
  second stream (the bootstraps' rewrite filter: response phases only, the rewrite in its
  ``envoy.lb`` metadata) rewrites it and touches no in-flight state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.struct_pb2 import Struct

from epp.datalayer.store import EndpointStore
from epp.server import replies
from tests.unit.extproc_harness import (
    BUFFERED,
    Harness,
    body_msg,
    endpoint,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    start,
)

NONE = 0
CHAT = b'{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
SSE = {":status": "200", "content-type": "text/event-stream"}


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    store = EndpointStore()
    for i in (1, 2):
        store.upsert(endpoint(i))
    h = await start(store)
    yield h
    await h.channel.close()
    await h.server.stop(0)


def _rewrite_metadata(resp: ep.ProcessingResponse) -> dict[str, str] | None:
    ns = resp.dynamic_metadata.fields["envoy.lb"].struct_value
    if replies.REWRITE_METADATA_KEY not in ns.fields:
        return None
    fields = ns.fields[replies.REWRITE_METADATA_KEY].struct_value.fields
    return {k: v.string_value for k, v in fields.items()}


async def test_buffered_asks_for_the_body_of_a_rewritten_response_only(harness: Harness) -> None:
    rewritten = await harness.exchange(
        [
            headers_msg({"x-llm-d-model-name-rewrite": "demo-lora"}, mode=BUFFERED, resp_mode=NONE),
            body_msg(CHAT, True),
            response_headers_msg({**SSE, "content-length": "99"}),
            response_body_msg(b'data: {"model":"demo-lora"}\n\n', True),
        ],
        expect=4,
    )
    assert _rewrite_metadata(rewritten[1]) == {"incoming": "demo", "target": "demo-lora"}
    headers_reply = rewritten[2]
    assert headers_reply.HasField("mode_override")
    assert headers_reply.mode_override.response_body_mode == pm.ProcessingMode.FULL_DUPLEX_STREAMED
    assert headers_reply.mode_override.request_body_mode == pm.ProcessingMode.BUFFERED
    assert "content-length" in headers_reply.response_headers.response.header_mutation.remove_headers
    piece = rewritten[3].response_body.response.body_mutation.streamed_response
    assert piece.body == b'data: {"model":"demo"}\n\n' and piece.end_of_stream

    plain = await harness.exchange(
        [headers_msg({}, mode=BUFFERED, resp_mode=NONE), body_msg(CHAT, True), response_headers_msg(SSE)],
        expect=3,
    )
    assert _rewrite_metadata(plain[1]) is None
    assert not plain[2].HasField("mode_override")


async def test_full_duplex_routing_stream_leaves_a_rewritten_response_to_the_rewrite_filter(
    harness: Harness,
) -> None:
    out = await harness.exchange(
        [
            headers_msg({"x-gateway-model-name-rewrite": "demo-lora"}, resp_mode=NONE),
            body_msg(CHAT, True),
            response_headers_msg({**SSE, "content-length": "99"}),
        ],
        expect=3,
    )
    assert _rewrite_metadata(out[0]) == {"incoming": "demo", "target": "demo-lora"}
    assert not out[2].HasField("mode_override")  # Envoy ignores it in full duplex
    assert "content-length" not in out[2].response_headers.response.header_mutation.remove_headers


async def test_the_rewrite_filter_stream_rewrites_the_body_from_its_metadata(harness: Harness) -> None:
    first = response_headers_msg({":status": "200", "content-type": "application/json"})
    md = Struct()
    md.update({replies.REWRITE_METADATA_KEY: {"incoming": "demo", "target": "demo-lora"}})
    first.metadata_context.filter_metadata["envoy.lb"].CopyFrom(md)
    before = [e.inflight for e in harness.store.endpoints()]
    out = await harness.exchange(
        [first, response_body_msg(b'{"id":"1","model":', False), response_body_msg(b'"demo-lora"}', True)],
        expect=2,
    )
    assert "content-length" in out[0].response_headers.response.header_mutation.remove_headers
    whole = out[1].response_body.response.body_mutation.streamed_response
    assert whole.body == b'{"id":"1","model":"demo"}' and whole.end_of_stream
    assert [e.inflight for e in harness.store.endpoints()] == before


async def test_a_response_stream_without_rewrite_metadata_passes_through(harness: Harness) -> None:
    out = await harness.exchange([response_headers_msg(SSE)], expect=1)
    assert not out[0].response_headers.response.header_mutation.remove_headers


async def test_the_client_rewrite_header_can_be_ignored(harness: Harness) -> None:
    harness.director.client_model_rewrite = False
    out = await harness.exchange(
        [headers_msg({"x-llm-d-model-name-rewrite": "demo-lora"}), body_msg(CHAT, True)], expect=2
    )
    assert _rewrite_metadata(out[0]) is None
    assert out[1].request_body.response.body_mutation.streamed_response.body == CHAT
    assert "x-llm-d-model-name-rewrite" in out[0].request_headers.response.header_mutation.remove_headers


async def test_the_current_rewrite_header_name_wins(harness: Harness) -> None:
    out = await harness.exchange(
        [
            headers_msg({"x-llm-d-model-name-rewrite": "new", "x-gateway-model-name-rewrite": "old"}),
            body_msg(CHAT, True),
        ],
        expect=2,
    )
    assert _rewrite_metadata(out[0]) == {"incoming": "demo", "target": "new"}
