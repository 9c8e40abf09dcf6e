"""A minimal ext_proc server: the gRPC/Envoy floor the EPP's CPU per request is compared with.

Every request goes to the fixed ``--destination`` with the EPP's message exchange and gRPC stack,
but no parsing, scheduling or metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf.struct_pb2 import Struct

from epp.framework.wire import DESTINATION_HEADER, LB_NAMESPACE
from epp.server import heap
from epp.server.h2grpc import Server
from epp.server.replies import BODY_PIECE_LIMIT

# ProcessingMode.BodySendMode values
STREAMED: int = pm.ProcessingMode.STREAMED
BUFFERED: int = pm.ProcessingMode.BUFFERED
FULL_DUPLEX_STREAMED: int = pm.ProcessingMode.FULL_DUPLEX_STREAMED


def routing_common(destination: str) -> ep.CommonResponse:
    mutation = ep.HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()))
        ]
    )
    return ep.CommonResponse(clear_route_cache=True, header_mutation=mutation)


def destination_metadata(destination: str) -> Struct:
    md = Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
    return md


class StubProcessor(ep_grpc.ExternalProcessorServicer):
    """Routes every request to one destination; the replies that never change are built once."""

    def __init__(self, destination: str) -> None:
        common, metadata = routing_common(destination), destination_metadata(destination)
        self.route_headers = ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
        )
        self.route_body = ep.ProcessingResponse(
            request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata
        )
        self.continue_request_headers = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        self.continue_request_body = ep.ProcessingResponse(request_body=ep.BodyResponse())
        self.continue_response_headers = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        self.continue_response_body = ep.ProcessingResponse(response_body=ep.BodyResponse())
        self.request_trailers = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        self.response_trailers = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        read, write = context.read, context.write
        req_mode = resp_mode = FULL_DUPLEX_STREAMED
        chunks: list[bytes] = []
        pending = 0  # STREAMED: body chunks not answered yet
        routed = False
        while True:
            req = await read()
            if req is grpc.aio.EOF:
                return
            which = req.WhichOneof("request")
            if which == "request_headers":
                if req.HasField("protocol_config"):
                    req_mode = req.protocol_config.request_body_mode
                    resp_mode = req.protocol_config.response_body_mode
                if req.request_headers.end_of_stream:
                    routed = True
                    await write(self.route_headers)
                elif req_mode == BUFFERED:
                    await write(self.continue_request_headers)
            elif which == "request_body":
                body = req.request_body
                if req_mode == BUFFERED:
                    if body.end_of_stream:
                        routed = True
                        await write(self.route_body)
                    else:
                        await write(ep.ProcessingResponse(request_body=ep.BodyResponse()))
                    continue
                if req_mode == STREAMED:  # routed in the delayed headers reply, then one reply per chunk
                    pending += 1
                    if body.end_of_stream:
                        routed = True
                        await write(self.route_headers)
                        for _ in range(pending):
                            await write(self.continue_request_body)
                        pending = 0
                    continue
                chunks.append(body.body)
                if body.end_of_stream:
                    routed = True
                    await write(self.route_headers)
                    for piece in _streamed_request_body(chunks, end_of_stream=True):
                        await write(piece)
                    chunks = []
            elif which == "request_trailers":
                if not routed and req_mode == STREAMED:
                    routed = True
                    await write(self.route_headers)
                    for _ in range(pending):
                        await write(self.continue_request_body)
                    pending = 0
                if not routed and req_mode == FULL_DUPLEX_STREAMED:
                    routed = True
                    await write(self.route_headers)
                    for piece in _streamed_request_body(chunks, end_of_stream=False):
                        await write(piece)
                    chunks = []
                await write(self.request_trailers)
            elif which == "response_headers":
                await write(self.continue_response_headers)
            elif which == "response_body":
                if resp_mode == FULL_DUPLEX_STREAMED:
                    piece = ep.StreamedBodyResponse(
                        body=req.response_body.body, end_of_stream=req.response_body.end_of_stream
                    )
                    mutation = ep.BodyMutation(streamed_response=piece)
                    await write(
                        ep.ProcessingResponse(
                            response_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
                        )
                    )
                else:
                    await write(self.continue_response_body)
            elif which == "response_trailers":
                await write(self.response_trailers)


def _streamed_request_body(chunks: list[bytes], end_of_stream: bool) -> list[ep.ProcessingResponse]:
    """The body echoed as the EPP echoes it: ``streamed_response`` pieces of at most
    ``BODY_PIECE_LIMIT`` bytes (the reference's limit), ``end_of_stream`` on the last."""
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    starts = range(0, max(len(body), 1), BODY_PIECE_LIMIT)
    last = starts[-1]
    out = []
    for i in starts:
        piece = ep.StreamedBodyResponse(
            body=body[i : i + BODY_PIECE_LIMIT], end_of_stream=end_of_stream and i == last
        )
        mutation = ep.BodyMutation(streamed_response=piece)
        out.append(
            ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
            )
        )
    return out


async def serve(host: str, port: int, destination: str, socket: str = "", kind: str = "grpc") -> None:
    limit = 11 << 20  # as the EPP: a BUFFERED body arrives (and may go back) in one message
    server: Any
    if kind == "h2grpc":
        server = Server(max_receive_message_length=limit, max_send_message_length=limit)
    else:
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.max_concurrent_streams", 100_000),
            ]
        )
    ep_grpc.add_ExternalProcessorServicer_to_server(StubProcessor(destination), server)
    server.add_insecure_port(f"{host}:{port}")
    if socket:
        server.add_insecure_port(f"unix:{socket}")
    heap.keep_large_buffers()  # as the EPP does when it starts serving
    await server.start()
    print(f"ext_proc stub on {host}:{port}, every request to {destination}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9002, help="ext_proc port (default 9002)")
    parser.add_argument("--destination", required=True, metavar="IP:PORT", help="where every request goes")
    parser.add_argument("--socket", default="", metavar="PATH", help="also listen on this Unix socket")
    parser.add_argument(
        "--server", choices=("grpc", "h2grpc"), default="grpc", help="grpc.aio (default) or epp's h2grpc"
    )
    args = parser.parse_args(argv)
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(args.host, args.port, args.destination, args.socket, args.server))
    return 0


if __name__ == "__main__":
    sys.exit(main())
