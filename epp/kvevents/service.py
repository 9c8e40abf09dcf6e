"""KV-event ingestion: ZMQ subscribers, sequence tracking and replay, all on one background thread.

Per endpoint one SUB socket connects to ``tcp://<address>:<socket_port + rank>``; in the central
mode one SUB socket binds ``central_endpoint`` and engines connect to it (the endpoint is named by
the topic ``kv@<pod>@<model>``: ``ip:port``, an IP or a pod name). One pyzmq poller serves every
socket; the asyncio loop never runs ingestion. Per stream the batch sequence is tracked:

- sequence lower than the last one (the engine restarted): the endpoint is cleared, then replayed
  from 0 when a replay socket is configured;
- the stream resumes after its socket disconnected or its server was down (``endpoint_down``): the
  engine may have restarted (its numbering starts again at 0, so even an equal sequence number is no
  duplicate). With a replay socket the batch last seen is asked again and compared with the one
  applied (same engine: the stream goes on; otherwise the endpoint is cleared and replayed from 0);
  without one the endpoint is cleared and the next batch is taken as it comes. From the
  disconnection (or the server found down) until that check ends, ``trusted`` is False: the
  endpoint's entries may be a dead engine's, and the prefix producer matches nothing on them;
- a gap: replay from last + 1; without replay, or when the replay fails (no answer within
  ``REPLAY_IDLE_TIMEOUT``, the start no longer buffered, a malformed reply), the endpoint is cleared
  (its entries are stale) and the stream goes on live; a failed replay is not retried for
  ``REPLAY_COOLDOWN``;
- a replay answer that skips sequence numbers, or stops without its end marker after some batches
  (an engine's ROUTER drops what exceeds its send high-water mark), is asked again from the first
  missing batch; ``REPLAY_RETRIES`` answers in a row that bring nothing new fail the replay;
- a malformed message: counted, the endpoint cleared (its events were lost);
- an unreachable socket: ZMQ keeps reconnecting; every retry is counted.

Topics: an endpoint's own socket takes batches whose topic starts with ``topic_filter`` and those
without a topic (vLLM's default topic is ``""``: the socket names the endpoint); other topics are
dropped, counted and logged. The central socket needs the topic to name the endpoint.

Control calls (``add_endpoint``, ``remove_endpoint``, ``stop``) may come from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from epp.kvevents import metrics
from epp.kvevents.apply import EventApplier
from epp.kvevents.decode import DecodeError, decode_batch

__all__ = ["KVEventsIngester", "Target"]

log = structlog.get_logger("epp.kvevents")

REPLAY_IDLE_TIMEOUT = 2.0
REPLAY_COOLDOWN = 30.0
REPLAY_RETRIES = 3  # answers in a row without a new batch before a replay fails
REPLAY_MAX_ROUNDS = 64  # answers per replay at most (a 10,000-batch buffer over 1,000-batch answers)
MAX_PENDING = 100_000  # live messages held while a replay runs
MAX_MESSAGE_BYTES = 128 << 20  # a larger message drops the connection (ZMQ reconnects)
_BURST = 256  # messages taken from one socket per poll round (fairness)
_TICK = 0.2
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_LOG_INTERVAL = 30.0
_RETRY_BIND = 5.0
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


@dataclass(slots=True, frozen=True)
class Target:
    """An endpoint as ingestion sees it (``key`` names it in the index)."""

    key: str
    address: str
    port: int
    name: str = ""
    pod_name: str = ""
    rank: int = 0
    events_port: int = 0  # the endpoint's own PUB port (label); 0: the configured socket port + rank
    replay_port: int = 0  # the endpoint's own replay port (label); 0: the configured one + rank

    @property
    def hostport(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


@dataclass(slots=True)
class _Replay:
    dealer: zmq.Socket[Any]
    start: int
    expected: int
    deadline: float
    received: int = 0
    verify: bool = False  # the first answer must be the batch last applied (``start``), unchanged
    matched: bool = False
    retries: int = 0  # answers in a row that brought no new batch
    rounds: int = 1


@dataclass(slots=True)
class _Seq:
    """One event stream's position (an endpoint's SUB socket, or a pod of the central socket)."""

    pod: str
    replay_endpoint: str = ""
    last: int | None = None
    digest: int = 0  # hash of the last applied batch (restart check after a reconnection)
    suspect: bool = False  # disconnected or down since ``last``: check for a restart on resuming
    unverified: bool = False  # disconnected or down, restart check not finished: entries attract nothing
    topic: str = ""
    replay: _Replay | None = None
    pending: list[tuple[str, int, bytes]] = field(default_factory=list)
    replay_failed_at: float = -REPLAY_COOLDOWN


@dataclass(slots=True)
class _Stream:
    target: Target
    endpoint: str
    sub: zmq.Socket[Any]
    monitor: zmq.Socket[Any]
    seq: _Seq
    connected: bool = False


class KVEventsIngester:
    """The ingestion thread and its sockets; ``central_endpoint``: also bind one socket engines
    connect to."""

    def __init__(
        self,
        applier: EventApplier,
        *,
        engine: str = "vllm",
        topic_filter: str = "kv@",
        socket_port: int = 5557,
        replay_port: int = 0,
        central_endpoint: str = "",
        on_tick: Callable[[float], None] | None = None,
    ) -> None:
        self.applier = applier
        self.index = applier.index
        self.engine = engine
        self.topic_filter = topic_filter
        self.socket_port = socket_port
        self.replay_port = replay_port
        self.central_endpoint = central_endpoint
        self._on_tick = on_tick
        self._commands: deque[tuple[str, Any]] = deque()
        self._targets: dict[str, Target] = {}  # thread-owned copy
        self.streams: dict[str, _Stream] = {}  # endpoint key -> stream (thread-owned; read by tests)
        self._central: zmq.Socket[Any] | None = None
        self._central_seq: dict[str, _Seq] = {}
        self._unknown_pods: set[str] = set()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._wake_lock = threading.Lock()
        self._wake_tx: zmq.Socket[Any] | None = None
        self._wake_rx: zmq.Socket[Any] | None = None
        self._stopping = False
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[Any], tuple[str, Any]] = {}
        self._logged: dict[tuple[str, str], float] = {}
        self._resubscribe: list[Target] = []
        self._next_bind = 0.0
        self.central_error = ""

    # --- control (any thread) -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._poller = zmq.Poller()
        self._by_socket = {}
        for target in self._resubscribe:  # started again after a stop: the same subscriptions
            self._commands.appendleft(("add", (target, True)))
        self._resubscribe = []
        ctx = self._ctx = zmq.Context()
        name = f"inproc://kvevents-wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(name)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(name)
        metrics.POOL_CAPACITY.set(1)
        self._thread = threading.Thread(target=self._run, name="epp-kv-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._wake()
        thread.join(timeout)
        self._thread = None
        with self._wake_lock:
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
                self._wake_tx = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def add_endpoint(self, target: Target, subscribe: bool = True) -> None:
        """Know ``target`` (central-socket topics name it); ``subscribe``: connect to its socket."""
        self._commands.append(("add", (target, subscribe)))
        self._wake()

    def remove_endpoint(self, key: str) -> None:
        self._commands.append(("remove", key))
        self._wake()

    def endpoint_down(self, key: str, down: bool) -> None:
        """The endpoint's server was found gone (``down``), or back: on its return its stream is
        checked for a restart (see the module docstring)."""
        self._commands.append(("down", (key, down)))
        self._wake()

    def trusted(self, key: str) -> bool:
        """False while ``key``'s entries may belong to an engine that is gone: its event stream
        disconnected or its server was down, and the restart check on its return has not finished
        (read from any thread)."""
        stream = self.streams.get(key)
        seq = stream.seq if stream is not None else self._central_seq.get(key)
        return seq is None or not seq.unverified

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx is not None:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._ctx is not None and self._wake_rx is not None
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._by_socket[self._wake_rx] = ("wake", None)
        if self.central_endpoint:
            self._open_central()
        try:
            while not self._stopping:
                try:
                    self._round()
                except Exception as e:  # never let one bad message end ingestion
                    log.error("kv-events ingestion error", error=repr(e))
                    time.sleep(0.05)
        finally:
            self._resubscribe = [s.target for s in self.streams.values()]
            for key in list(self.streams):
                self._close_stream(key)
            self._central_seq.clear()
            if self._central is not None:
                self._central.close(linger=0)
                self._central = None
            self._wake_rx.close(linger=0)
            metrics.ACTIVE_SUBSCRIBERS.set(0)
            metrics.POOL_QUEUE_DEPTH.set(0)

    def _round(self) -> None:
        now = time.monotonic()
        timeout = _TICK
        for seq in self._replaying():
            assert seq.replay is not None
            timeout = min(timeout, max(0.0, seq.replay.deadline - now))
        events = self._poller.poll(int(timeout * 1000) + 1)
        self._drain_commands()
        for sock, _ in events:
            entry = self._by_socket.get(sock)
            if entry is None:
                continue
            kind, obj = entry
            if kind == "wake":
                while True:
                    try:
                        sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            elif kind == "sub":
                self._recv_live(obj, sock)
            elif kind == "central":
                self._recv_central(sock)
            elif kind == "monitor":
                self._monitor(obj)
            elif kind == "replay":
                self._recv_replay(obj)
        now = time.monotonic()
        for seq in self._replaying():
            assert seq.replay is not None
            if now >= seq.replay.deadline:
                if seq.replay.received > 0 or seq.replay.rounds > 1:
                    self._replay_again(seq, "the replay answer stopped before its end")
                else:
                    self._replay_failed(seq, "replay-timeout", "no replay answer in time")
        self.index.expire(now)
        if self.central_endpoint and self._central is None and now >= self._next_bind:
            self._open_central()  # the address was taken: keep trying, as the reference does
        if self._on_tick is not None:
            self._on_tick(now)

    def _replaying(self) -> list[_Seq]:
        return [s.seq for s in self.streams.values() if s.seq.replay is not None]

    def _drain_commands(self) -> None:
        commands = self._commands
        while commands:
            op, arg = commands.popleft()
            if op == "add":
                self._add(*arg)
            elif op == "remove":
                self._remove(arg)
            elif op == "down":
                self._set_down(*arg)

    def _set_down(self, key: str, down: bool) -> None:
        stream = self.streams.get(key)
        seq = stream.seq if stream is not None else self._central_seq.get(key)
        if seq is None:
            return
        if down:
            seq.suspect = seq.unverified = True
        elif seq.suspect:
            self._resync(seq)

    def _add(self, target: Target, subscribe: bool) -> None:
        old = self._targets.get(target.key)
        self._targets[target.key] = target
        if not subscribe:
            if target.key in self.streams:
                self._close_stream(target.key)
            return
        metrics.seed_subscriber(target.key)
        endpoint = self._endpoint_of(target, self.socket_port, target.events_port)
        stream = self.streams.get(target.key)
        if stream is not None:
            if stream.endpoint == endpoint and old == target:
                return
            self._close_stream(target.key)
            self._clear(target.key)
        self._open_stream(target, endpoint)

    def _remove(self, key: str) -> None:
        self._targets.pop(key, None)
        self._close_stream(key)
        self._central_seq.pop(key, None)
        self.index.remove_pod(key)
        self.applier.forget(key)
        metrics.drop_subscriber(key)

    @staticmethod
    def _endpoint_of(target: Target, port: int, own_port: int = 0) -> str:
        """``tcp://address:port``: the endpoint's own port when it announces one, else ``port + rank``."""
        host = f"[{target.address}]" if ":" in target.address else target.address
        return f"tcp://{host}:{own_port or port + target.rank}"

    def _open_stream(self, target: Target, endpoint: str) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, MAX_PENDING)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.RECONNECT_IVL, 1000)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        if ":" in target.address:
            sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # topics filtered in _recv_live (vLLM's default is "")
        monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        if target.replay_port:
            replay = self._endpoint_of(target, 0, target.replay_port)
        else:
            replay = self._endpoint_of(target, self.replay_port) if self.replay_port > 0 else ""
        stream = _Stream(target, endpoint, sub, monitor, _Seq(target.key, replay))
        self.streams[target.key] = stream
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self._by_socket[sub] = ("sub", stream)
        self._by_socket[monitor] = ("monitor", stream)
        try:
            sub.connect(endpoint)
        except zmq.ZMQError as e:
            metrics.ZMQ_ERRORS.labels(target.key, "connect").inc()
            self._log(
                target.key, "connect", "cannot connect the KV-events socket", endpoint=endpoint, error=str(e)
            )
        metrics.ACTIVE_SUBSCRIBERS.set(len(self.streams))
        log.info("kv-events subscriber added", endpoint=target.key, address=endpoint, replay=replay or None)
        if replay:
            self._start_replay(stream.seq, 0)  # rebuild without waiting for live traffic

    def _close_stream(self, key: str) -> None:
        stream = self.streams.pop(key, None)
        if stream is None:
            return
        if stream.seq.replay is not None:
            self._close_replay(stream.seq)
        for sock in (stream.sub, stream.monitor):
            self._poller.unregister(sock)
            self._by_socket.pop(sock, None)
        try:
            stream.sub.disable_monitor()
        except zmq.ZMQError:
            pass
        stream.monitor.close(linger=0)
        stream.sub.close(linger=0)
        metrics.ACTIVE_SUBSCRIBERS.set(len(self.streams))
        self._update_depth()

    def _open_central(self) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, MAX_PENDING)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # a topic not naming an endpoint is reported in _resolve
        try:
            sock.bind(self.central_endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self.central_error = str(e)
            self._next_bind = time.monotonic() + _RETRY_BIND
            metrics.ZMQ_ERRORS.labels("", "bind").inc()
            self._log(
                "", "bind", "cannot bind the KV-events socket", address=self.central_endpoint, error=str(e)
            )
            return
        self.central_error = ""
        self._central = sock
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = ("central", None)
        log.info("kv-events socket bound", address=self.central_endpoint)

    # --- live messages ------------------------------------------------------------------------

    def _recv_live(self, stream: _Stream, sock: zmq.Socket[Any]) -> None:
        key = stream.target.key
        received = metrics.MESSAGES_RECEIVED.labels(key)
        for _ in range(_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            received.inc()
            if self.streams.get(key) is not stream:
                return
            msg = self._frames(frames, None)
            if msg is None:
                self._lost(stream.seq, "frame", "malformed KV-events frame", frames=len(frames))
                continue
            if msg[0] and not msg[0].startswith(self.topic_filter):
                metrics.ZMQ_ERRORS.labels(key, "topic").inc()
                self._log(
                    key,
                    "topic",
                    "KV events of another topic dropped: the engine's kv-events topic must start with "
                    "topicFilter (or be empty, vLLM's default)",
                    topic=msg[0],
                    topic_filter=self.topic_filter,
                )
                continue
            self._sequence(stream.seq, *msg)

    def _recv_central(self, sock: zmq.Socket[Any]) -> None:
        for _ in range(_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._frames(frames, "")
            if msg is None:
                continue
            topic, seq_no, payload = msg
            pod = self._resolve(topic, payload)
            if pod is None:
                continue
            metrics.MESSAGES_RECEIVED.labels(pod).inc()
            seq = self._central_seq.get(pod)
            if seq is None:
                seq = self._central_seq[pod] = _Seq(pod)
            self._sequence(seq, topic, seq_no, payload)

    def _frames(self, frames: list[bytes], key: str | None) -> tuple[str, int, bytes] | None:
        """The (topic, sequence number, payload) of a message; a malformed one is counted as a
        ``frame`` error here when ``key`` is given (``None``: the caller's ``_lost`` counts it)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            if key is not None:
                metrics.ZMQ_ERRORS.labels(key, "frame").inc()
            return None
        return frames[0].decode("utf-8", "replace"), int.from_bytes(frames[1], "big"), frames[2]

    def _resolve(self, topic: str, payload: bytes) -> str | None:
        """The endpoint key named by a central-socket topic ``kv@<pod>@<model>``."""
        parts = topic.split("@")
        pod_id = parts[1] if len(parts) == 3 else topic
        candidates: list[Target] = []
        for t in self._targets.values():
            if t.hostport == pod_id or f"{t.address}:{t.port}" == pod_id:
                return t.key
            if pod_id in (t.address, t.name, t.pod_name):
                candidates.append(t)
        if len(candidates) > 1:
            try:
                rank = decode_batch(payload, self.engine).data_parallel_rank
            except DecodeError:
                rank = None
            for t in candidates:
                if t.rank == (rank or 0):
                    return t.key
        if candidates:
            return candidates[0].key
        metrics.ZMQ_ERRORS.labels("", "unknown_pod").inc()
        if pod_id not in self._unknown_pods and len(self._unknown_pods) < 1024:
            self._unknown_pods.add(pod_id)
            if len(parts) != 3 or not topic.startswith(self.topic_filter):
                log.warning(
                    "KV events on the central socket whose topic names no endpoint dropped: set the "
                    "engine's kv-events topic to kv@<pod IP>@<model> (vLLM's default topic is empty)",
                    topic=topic,
                    topic_filter=self.topic_filter,
                )
            else:
                log.warning("KV events from an unknown endpoint dropped", topic=topic)
        return None

    def _can_replay(self, seq: _Seq) -> bool:
        return bool(seq.replay_endpoint) and time.monotonic() - seq.replay_failed_at >= REPLAY_COOLDOWN

    def _sequence(self, seq: _Seq, topic: str, n: int, payload: bytes) -> None:
        """A live message of a stream not replaying (or a pending one after its replay)."""
        if seq.replay is not None:
            self._hold(seq, topic, n, payload)
            return
        seq.topic = topic
        if seq.suspect and seq.last is not None:
            self._resync(seq)
            if seq.replay is not None:
                self._hold(seq, topic, n, payload)
                return
        last = seq.last
        if last is not None:
            if n == last:
                return
            if n < last:
                log.warning(
                    "KV-event sequence went back: engine restarted", endpoint=seq.pod, last=last, seq=n
                )
                metrics.ENDPOINT_CLEARS.labels(seq.pod, "restart").inc()
                self._clear(seq.pod)
                seq.last = None
                seq.unverified = False
                if self._can_replay(seq):
                    self._start_replay(seq, 0)
                    self._hold(seq, topic, n, payload)
                    return
            elif n > last + 1:
                if self._can_replay(seq):
                    log.info("KV-event gap: replaying", endpoint=seq.pod, last=last, seq=n)
                    self._start_replay(seq, last + 1)
                    self._hold(seq, topic, n, payload)
                    return
                metrics.ZMQ_ERRORS.labels(seq.pod, "gap").inc()
                metrics.ENDPOINT_CLEARS.labels(seq.pod, "gap").inc()
                self._log(seq.pod, "gap", "KV-event gap without replay: endpoint cleared", last=last, seq=n)
                self._clear(seq.pod)
        elif n > 0 and self._can_replay(seq):
            self._start_replay(seq, 0)  # joined mid-stream
            self._hold(seq, topic, n, payload)
            return
        self._process(seq, n, payload)

    def _hold(self, seq: _Seq, topic: str, n: int, payload: bytes) -> None:
        seq.pending.append((topic, n, payload))
        if len(seq.pending) > MAX_PENDING:
            self._replay_failed(seq, "replay-overflow", "too many live messages during a replay")
        else:
            self._update_depth()

    def _process(self, seq: _Seq, n: int, payload: bytes) -> None:
        seq.last = n
        seq.digest = hash(payload)
        try:
            self.applier.apply(seq.pod, decode_batch(payload, self.engine))
        except DecodeError as e:
            self._lost(seq, "decode", "malformed KV-event batch", error=str(e))
        except Exception as e:
            self._lost(seq, "apply", "KV-event batch failed", error=repr(e))

    def _lost(self, seq: _Seq, operation: str, message: str, **kw: Any) -> None:
        """Events of the endpoint were lost: its entries can no longer be trusted."""
        metrics.ZMQ_ERRORS.labels(seq.pod, operation).inc()
        metrics.ENDPOINT_CLEARS.labels(seq.pod, operation).inc()
        self._log(seq.pod, operation, message + ": endpoint cleared", **kw)
        self._clear(seq.pod)

    def _clear(self, pod: str) -> None:
        self.index.clear_pod(pod)
        self.applier.forget(pod)

    def _resync(self, seq: _Seq) -> None:
        """The stream resumes after a disconnection or a down server: was the engine restarted?"""
        seq.suspect = False
        if seq.last is None:
            seq.unverified = False
            return
        if seq.replay is not None:
            self._close_replay(seq)
        if self._can_replay(seq):
            self._start_replay(seq, seq.last, verify=True)  # a failure to ask clears (unverified too)
            return
        log.info("KV-event stream resumed without replay: endpoint cleared", endpoint=seq.pod, last=seq.last)
        metrics.ENDPOINT_CLEARS.labels(seq.pod, "restart").inc()
        self._clear(seq.pod)
        seq.last = None
        seq.unverified = False

    def _restarted(self, seq: _Seq, **kw: Any) -> None:
        """The replay showed another engine behind the stream: clear, rebuild from 0."""
        log.warning(
            "KV-event replay differs from the batch applied: engine restarted", endpoint=seq.pod, **kw
        )
        metrics.ENDPOINT_CLEARS.labels(seq.pod, "restart").inc()
        self._close_replay(seq)
        self._clear(seq.pod)
        seq.last = None
        seq.unverified = False
        if self._can_replay(seq):
            self._start_replay(seq, 0)
        else:
            self._flush_pending(seq)

    # --- replay -------------------------------------------------------------------------------

    def _start_replay(self, seq: _Seq, start: int, verify: bool = False) -> None:
        assert self._ctx is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, MAX_PENDING)  # take the answer in as fast as it comes
        try:
            dealer.connect(seq.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            dealer.close(linger=0)
            seq.replay = None
            self._replay_failed(seq, "replay-connect", "cannot request a replay", error=str(e))
            return
        seq.replay = _Replay(dealer, start, start, time.monotonic() + REPLAY_IDLE_TIMEOUT, verify=verify)
        self._poller.register(dealer, zmq.POLLIN)
        self._by_socket[dealer] = ("replay", seq)

    def _close_replay(self, seq: _Seq) -> None:
        replay = seq.replay
        seq.replay = None
        if replay is None:
            return
        self._poller.unregister(replay.dealer)
        self._by_socket.pop(replay.dealer, None)
        replay.dealer.close(linger=0)

    def _recv_replay(self, seq: _Seq) -> None:
        for _ in range(_BURST):
            replay = seq.replay
            if replay is None:
                return
            try:
                frames = replay.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            replay.deadline = time.monotonic() + REPLAY_IDLE_TIMEOUT
            if frames and not frames[0]:
                frames = frames[1:]
            if len(frames) == 2:
                topic, seq_b, payload = seq.topic, frames[0], frames[1]
            elif len(frames) == 3:
                topic, seq_b, payload = frames[0].decode("utf-8", "replace"), frames[1], frames[2]
            else:
                self._replay_failed(seq, "replay-incomplete", "malformed replay frame", frames=len(frames))
                return
            if len(seq_b) != 8:
                self._replay_failed(seq, "replay-incomplete", "malformed replay sequence")
                return
            if seq_b == _END_SEQ or not payload:
                if replay.verify:
                    self._restarted(seq, last=replay.start, replayed="nothing")
                else:
                    self._replay_done(seq)
                return
            n = int.from_bytes(seq_b, "big")
            if replay.verify:
                if n != replay.start or hash(payload) != seq.digest:
                    self._restarted(seq, last=replay.start, got=n)
                    return
                replay.verify, replay.matched, replay.expected = False, True, n + 1
                seq.unverified = False  # the same engine: its entries hold
                continue
            if n < replay.expected:
                continue
            if n > replay.expected and (replay.start > 0 or replay.received > 0):
                self._replay_again(seq, "the replay answer skipped batches", got=n)
                return
            replay.received += 1
            replay.expected = n + 1
            seq.topic = topic
            self._process(seq, n, payload)

    def _replay_again(self, seq: _Seq, reason: str, **kw: Any) -> None:
        """Ask the rest of an incomplete replay answer again, from its first missing batch."""
        replay = seq.replay
        assert replay is not None
        retries = 0 if replay.received > 0 else replay.retries + 1
        if retries > REPLAY_RETRIES or replay.rounds >= REPLAY_MAX_ROUNDS:
            self._replay_failed(
                seq, "replay-incomplete", reason, expected=replay.expected, rounds=replay.rounds, **kw
            )
            return
        start, rounds = replay.expected, replay.rounds + 1
        log.info(reason + ": asking again", endpoint=seq.pod, expected=start, **kw)
        metrics.REPLAYS.labels(seq.pod, "retried").inc()
        self._close_replay(seq)
        self._start_replay(seq, start)
        if seq.replay is not None:
            seq.replay.retries, seq.replay.rounds = retries, rounds

    def _replay_done(self, seq: _Seq) -> None:
        replay = seq.replay
        assert replay is not None
        if replay.start > 0 and replay.received == 0 and not replay.matched:
            self._replay_failed(
                seq, "replay-incomplete", "replay start no longer buffered", start=replay.start
            )
            return
        self._close_replay(seq)
        metrics.REPLAYS.labels(seq.pod, "complete").inc()
        log.info("KV-event replay complete", endpoint=seq.pod, start=replay.start, replayed=replay.received)
        self._flush_pending(seq)

    def _replay_failed(self, seq: _Seq, operation: str, message: str, **kw: Any) -> None:
        self._close_replay(seq)
        seq.replay_failed_at = time.monotonic()
        seq.last = None
        seq.unverified = False  # cleared below
        self._lost(seq, operation, message, **kw)
        # counted once the endpoint is cleared: whoever sees the count sees the index without it
        metrics.REPLAYS.labels(seq.pod, "failed").inc()
        self._flush_pending(seq)

    def _flush_pending(self, seq: _Seq) -> None:
        pending, seq.pending = seq.pending, []
        for i, (topic, n, payload) in enumerate(pending):
            if seq.last is not None and n <= seq.last:
                continue  # held during the replay, which covered it
            self._sequence(seq, topic, n, payload)
            if seq.replay is not None:  # another replay started: keep the rest for after it
                seq.pending.extend(pending[i + 1 :])
                break
        self._update_depth()

    # --- connection state ---------------------------------------------------------------------

    def _monitor(self, stream: _Stream) -> None:
        for _ in range(_BURST):
            try:
                ev = recv_monitor_message(stream.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            kind = ev.get("event")
            key = stream.target.key
            if kind == zmq.EVENT_CONNECTED:
                stream.connected = True
                log.info("kv-events subscriber connected", endpoint=key, address=stream.endpoint)
                if stream.seq.suspect:
                    self._resync(stream.seq)
            elif kind == zmq.EVENT_DISCONNECTED:
                stream.connected = False
                stream.seq.suspect = stream.seq.unverified = True
                log.info("kv-events subscriber disconnected", endpoint=key, address=stream.endpoint)
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                metrics.RECONNECTIONS.labels(key).inc()
                self._log(key, "retry", "kv-events socket unreachable, retrying", address=stream.endpoint)

    def _update_depth(self) -> None:
        metrics.POOL_QUEUE_DEPTH.set(
            sum(len(s.seq.pending) for s in self.streams.values())
            + sum(len(s.pending) for s in self._central_seq.values())
        )

    def _log(self, pod: str, cause: str, message: str, **kw: Any) -> None:
        now = time.monotonic()
        key = (pod, cause)
        if now - self._logged.get(key, -_LOG_INTERVAL) < _LOG_INTERVAL:
            return
        if len(self._logged) > 4096:
            self._logged.clear()
        self._logged[key] = now
        log.warning(message, endpoint=pod or None, **kw)
