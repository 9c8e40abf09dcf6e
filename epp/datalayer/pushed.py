"""Pushed load: one thread holding a ZMQ SUB connection per endpoint to its load publisher.

Each message is decoded by the source's extractor and merged into the endpoint's ``Metrics``
(running, waiting, KV usage; the other fields keep the last scrape's values), fresh for the
staleness threshold like a scrape. Reports of several data-parallel ranks of one endpoint are
summed. Only the newest queued message per endpoint is decoded (a report is a snapshot); the
sockets' ZMQ file descriptors are watched in one epoll set, read at most every 20 ms.
``pushing(endpoint)`` is true while the last report is younger than the source's
``fallback_after``: the metrics scraper skips those endpoints and scrapes the others.
"""

from __future__ import annotations

import collections
import dataclasses
import selectors
import threading
import time
from typing import Any

import structlog
import zmq

from epp.datalayer.store import EndpointStore
from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import DataSource, Extractor, LoadExtractor, LoadReport, PushSource
from epp.metrics import DATALAYER_EXTRACT_ERRORS

log = structlog.get_logger("epp.datalayer.pushed")

_POLL_MS = 50
_MIN_CYCLE_S = 0.02  # at most one poll per this: a report waits up to it before it is read
_MAX_MESSAGE_BYTES = 64 << 10


class PushedLoad:
    """Receives one push source's load reports; ``start()`` from the serving loop, ``stop()``."""

    def __init__(
        self, store: EndpointStore, source: DataSource, extractor: Extractor, staleness: float
    ) -> None:
        if not isinstance(source, PushSource) or not isinstance(extractor, LoadExtractor):
            raise TypeError(f"{source!r} / {extractor!r}: not a push source with a load extractor")
        self._store = store
        self._source: PushSource = source
        self._extractor: LoadExtractor = extractor
        self.source_name = source.name
        self.staleness = staleness
        self.fallback_after = source.fallback_after
        self._errors = DATALAYER_EXTRACT_ERRORS.labels(source.type_name, extractor.type_name)
        self._commands: collections.deque[tuple[str, Endpoint]] = collections.deque()
        self._last: dict[Endpoint, float] = {}  # monotonic time of the last good report
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._subscribed = False
        self.received = 0  # messages decoded (a test and bench figure)

    def pushing(self, endpoint: Endpoint) -> bool:
        """True while the endpoint's last report is younger than ``fallback_after``."""
        last = self._last.get(endpoint)
        return last is not None and time.monotonic() - last < self.fallback_after

    def rest(self, endpoint: Endpoint) -> float:
        """Seconds until the endpoint's last report is ``fallback_after`` old (0: none, or past)."""
        last = self._last.get(endpoint)
        return 0.0 if last is None else max(0.0, last + self.fallback_after - time.monotonic())

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping.clear()
        if not self._subscribed:
            self._subscribed = True
            self._store.subscribe(on_add=self._on_add, on_remove=self._on_remove)
        else:
            for endpoint in self._store.endpoints():
                self._on_add(endpoint)
        self._thread = threading.Thread(target=self._run, name=f"epp-push {self.source_name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            thread.join(5.0)

    def _on_add(self, endpoint: Endpoint) -> None:
        if self._thread is not None or not self._stopping.is_set():
            self._commands.append(("add", endpoint))

    def _on_remove(self, endpoint: Endpoint) -> None:
        self._commands.append(("remove", endpoint))

    # --- the push thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        # Each socket's ZMQ_FD in one epoll set: a wake names the few sockets whose state changed,
        # where zmq.Poller would walk all of them (milliseconds for a thousand). The FD is
        # edge-triggered: a socket is drained until its EVENTS shows no message, and checked once
        # when registered (messages may have come before).
        selector = selectors.DefaultSelector()
        sockets: dict[Endpoint, zmq.Socket[Any]] = {}
        due: list[tuple[zmq.Socket[Any], _Stream]] = []
        try:
            while not self._stopping.is_set():
                while self._commands:
                    op, endpoint = self._commands.popleft()
                    old = sockets.pop(endpoint, None)
                    if old is not None:
                        selector.unregister(int(old.getsockopt(zmq.FD)))
                        old.close(0)
                        self._last.pop(endpoint, None)
                    if op == "add":
                        sock = self._open(ctx, endpoint)
                        if sock is not None:
                            sockets[endpoint] = sock
                            stream = _Stream(endpoint)
                            selector.register(
                                int(sock.getsockopt(zmq.FD)), selectors.EVENT_READ, (sock, stream)
                            )
                            due.append((sock, stream))
                started = time.monotonic()
                for key, _ in selector.select(0 if due else _POLL_MS / 1000):
                    due.append(key.data)
                for sock, stream in due:
                    if not sock.closed:
                        self._drain(sock, stream)
                due.clear()
                # reports are snapshots: let those of a busy second gather instead of waking per report
                wait = started + _MIN_CYCLE_S - time.monotonic()
                if wait > 0:
                    self._stopping.wait(wait)
        finally:
            selector.close()
            for sock in sockets.values():
                sock.close(0)
            ctx.term()

    def _open(self, ctx: zmq.Context[Any], endpoint: Endpoint) -> zmq.Socket[Any] | None:
        address = self._source.push_address(endpoint)
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 64)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            log.warning(
                "cannot subscribe to pushed load",
                endpoint=endpoint.metadata.key,
                address=address,
                error=str(e),
            )
            sock.close(0)
            return None
        return sock

    def _drain(self, sock: zmq.Socket[Any], stream: _Stream) -> None:
        payload: bytes | None = None
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # keep the newest message only
            try:  # (asking first: an empty socket's zmq.Again costs more than the question)
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames:
                payload = frames[-1]
        if payload is None:
            return
        endpoint = stream.endpoint
        try:
            report = self._extractor.extract_load(payload)
        except Exception as e:
            self._errors.inc()
            if not stream.failing:
                stream.failing = True
                log.warning("pushed load undecodable", endpoint=endpoint.metadata.key, error=str(e))
            return
        if report is None:
            return
        if stream.failing:
            stream.failing = False
            log.info("pushed load decodable again", endpoint=endpoint.metadata.key)
        self.received += 1
        now = time.monotonic()
        stream.ranks[report.dp_rank or 0] = (report, now)
        self._apply(endpoint, stream, now)

    def _apply(self, endpoint: Endpoint, stream: _Stream, now: float) -> None:
        running = waiting = tokens = capacity = 0
        for rank, (report, at) in list(stream.ranks.items()):
            if now - at >= self.fallback_after:  # a rank that stopped reporting
                del stream.ranks[rank]
                continue
            running += report.running
            waiting += report.waiting
            tokens += report.num_tokens
            capacity += report.max_total_tokens
        metrics = endpoint.metrics
        usage = min(1.0, tokens / capacity) if capacity > 0 else metrics.kv_cache_usage_percent
        endpoint.metrics = dataclasses.replace(
            metrics,
            running_requests_size=running,
            waiting_queue_size=waiting,
            kv_cache_usage_percent=usage,
            update_time=now,
            fresh_until=now + self.staleness,
            failure="",
            inflight_at_scrape=endpoint.inflight,
            peak_running=max(metrics.peak_running, running),
        )
        self._last[endpoint] = now


@dataclasses.dataclass(slots=True)
class _Stream:
    endpoint: Endpoint
    ranks: dict[int, tuple[LoadReport, float]] = dataclasses.field(default_factory=dict)
    failing: bool = False
