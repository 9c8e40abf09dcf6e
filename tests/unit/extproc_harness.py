"""A real grpc.aio ext_proc server with the EPP's stream handler, and a client that speaks like Envoy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf.struct_pb2 import Struct

from epp.datalayer.store import EndpointStore
from epp.framework import EndpointMetadata
from epp.server.director import Director
from epp.server.extproc import BUFFERED, FULL_DUPLEX_STREAMED, ExternalProcessor, StreamOptions, add_to_server
from tests.unit import factories


def endpoint(i: int, port: int = 8000) -> EndpointMetadata:
    return factories.metadata(f"ep-{i}", f"10.0.0.{i}", port)


@dataclass
class Harness:
    server: grpc.aio.Server
    channel: grpc.aio.Channel
    stub: ep_grpc.ExternalProcessorStub
    store: EndpointStore
    director: Director
    processor: ExternalProcessor

    async def exchange(
        self, messages: Sequence[ep.ProcessingRequest], expect: int
    ) -> list[ep.ProcessingResponse]:
        """Send ``messages`` (half-closing after), read ``expect`` replies, then check the stream ends."""
        call = self.stub.Process()
        for m in messages:
            await call.write(m)
        out = []
        for _ in range(expect):
            r = await call.read()
            assert r is not grpc.aio.EOF, f"stream ended after {len(out)} replies, expected {expect}"
            out.append(r)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        return out


async def start(
    store: EndpointStore, director: Director | None = None, opts: StreamOptions | None = None
) -> Harness:
    director = director or factories.director(store)
    server = grpc.aio.server()
    processor = ExternalProcessor(director, opts)
    add_to_server(processor, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Harness(server, channel, ep_grpc.ExternalProcessorStub(channel), store, director, processor)


def headers_msg(
    headers: dict[str, str],
    end_of_stream: bool = False,
    mode: int | None = FULL_DUPLEX_STREAMED,
    resp_mode: int = FULL_DUPLEX_STREAMED,
    subset: object | None = None,
) -> ep.ProcessingRequest:
    base = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        ":authority": "gw",
        "content-type": "application/json",
    }
    base.update(headers)
    req = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in base.items()]),
            end_of_stream=end_of_stream,
        )
    )
    if mode is not None:
        req.protocol_config.request_body_mode = mode  # type: ignore[assignment]
        req.protocol_config.response_body_mode = resp_mode  # type: ignore[assignment]
    if subset is not None:
        st = Struct()
        st.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(st)
    return req


def body_msg(body: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


def trailers_msg() -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_trailers=ep.HttpTrailers())


def response_headers_msg(headers: dict[str, str]) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])
        )
    )


def response_body_msg(body: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def destination_metadata(resp: ep.ProcessingResponse) -> str:
    return (
        resp.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )


__all__ = ["BUFFERED", "FULL_DUPLEX_STREAMED"]
