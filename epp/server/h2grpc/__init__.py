"""A small gRPC server on HTTP/2 for the ext_proc port: per request it costs a fraction of what
``grpc.aio`` costs (see docs/benchmarks.md), and it takes the same handlers."""

from epp.server.h2grpc.call import Call
from epp.server.h2grpc.limits import Limits
from epp.server.h2grpc.server import Server

__all__ = ["Call", "Limits", "Server"]
