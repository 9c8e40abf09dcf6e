"""What the handlers of one simulator app share: its app keys, the identity it answers with
(the ``x-inference-*`` headers) and the journal of the requests it received."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from epp.dev.sim.engine import Engine, SimConfig
from epp.dev.sim.kv_events import ZmqEventPublisher

JOURNAL_SIZE = 100

POD_HEADER = "x-inference-pod"

NAMESPACE_HEADER = "x-inference-namespace"

PORT_HEADER = "x-inference-port"


@dataclass(slots=True, frozen=True)
class Identity:
    """Who answers: reported in the ``x-inference-*`` headers."""

    pod: str
    namespace: str
    port: int


def identity_of(request: web.Request) -> Identity:
    """The identity for a request; the port is the one the connection actually arrived on."""
    config = request.app[CONFIG_KEY]
    port = _local_port(request) or config.port
    return Identity(pod=config.pod_name(port), namespace=config.namespace, port=port)


def _local_port(request: web.Request) -> int | None:
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2 and isinstance(sockname[1], int):
        return sockname[1]
    return None


async def add_identity_headers(request: web.Request, response: web.StreamResponse) -> None:
    identity = identity_of(request)
    response.headers[POD_HEADER] = identity.pod
    response.headers[NAMESPACE_HEADER] = identity.namespace
    response.headers[PORT_HEADER] = str(identity.port)


@dataclass(slots=True)
class RequestJournal:
    """The last received inference requests, exactly as they arrived."""

    entries: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=JOURNAL_SIZE))

    def record(self, request: web.Request, body: bytes) -> None:
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        text = body.decode("utf-8", errors="replace")
        self.entries.append({"path": request.path_qs, "headers": headers, "body": text})

    def clear(self) -> int:
        count = len(self.entries)
        self.entries.clear()
        return count


CONFIG_KEY = web.AppKey("config", SimConfig)

ENGINE_KEY = web.AppKey("engine", Engine)

JOURNAL_KEY = web.AppKey("journal", RequestJournal)

REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)

CREATED_KEY = web.AppKey("created", int)
# the pod name of a side app's engine (its serving port decides the default name)
POD_KEY = web.AppKey("pod", str)

RNG_KEY = web.AppKey("rng", random.Random)


@dataclass(slots=True)
class PublisherSlot:
    """The app's KV-event publisher, set once the server knows its pod name (after binding)."""

    publisher: ZmqEventPublisher | None = None


PUBLISHER_KEY = web.AppKey("kv_events_publisher", PublisherSlot)

SCRAPES_KEY = web.AppKey("metrics_scrapes", list)  # [count]: the GET /metrics served
