"""``zmq-metrics-data-source``: engines push their load over ZMQ (SGLang's ``LoadStat`` messages).

One SUB connection per endpoint to ``tcp://<endpoint address>:<port>``; the messages go to the
source's extractor (``zmq-state-extractor``) on the data layer's push thread. An endpoint whose
pushes stopped for ``fallbackAfter`` is scraped again by the metrics source.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import DataSource, Endpoint, register
from epp.framework.durations import parse_go_duration
from epp.framework.interfaces import Handle

DEFAULT_LOAD_PORT = 5556
LOAD_PAYLOAD = "load-stat"
LOAD_PORT_LABEL = "epp/load-port"
"""Endpoint label: the port of the endpoint's load publisher, when it is not the source's ``port``."""


@dataclass(slots=True, frozen=True)
class ZmqMetricsDataSourceParams:
    port: int = DEFAULT_LOAD_PORT
    fallback_after: str = "1s"  # pushes older than this: the endpoint is scraped again

    def validate(self) -> str | None:
        if not 1 <= self.port <= 65535:
            return f"port: invalid port {self.port}: must be between 1 and 65535"
        seconds = parse_go_duration(self.fallback_after)
        if seconds is None or seconds <= 0:
            return (
                f'fallbackAfter: invalid duration {self.fallback_after!r}: a positive duration such as "1s"'
            )
        return None


@register
class ZmqMetricsDataSource(DataSource):
    type_name = "zmq-metrics-data-source"
    Params = ZmqMetricsDataSourceParams
    payload = LOAD_PAYLOAD

    def __init__(self, name: str, params: ZmqMetricsDataSourceParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.params: ZmqMetricsDataSourceParams = params
        self.fallback_after: float = parse_go_duration(params.fallback_after) or 1.0

    def push_address(self, endpoint: Endpoint) -> str:
        """The endpoint's publisher: its pod address (its node's is not used) and ``port``, or the
        port its ``LOAD_PORT_LABEL`` names (several engines on one host)."""
        host = endpoint.metadata.address
        port = endpoint.metadata.labels.get(LOAD_PORT_LABEL) or self.params.port
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return f"tcp://{authority}"
