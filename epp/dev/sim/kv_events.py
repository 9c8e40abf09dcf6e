"""vLLM's KV-cache event publisher for the simulator: a ZMQ PUB socket plus a ROUTER replay socket.

Every batch goes out as ``[topic, seq (8 bytes big-endian), msgpack EventBatch]``; ``seq`` starts at 0
and grows by one per batch. The batch is msgspec's array form ``[ts, events, data_parallel_rank]``;
events are tagged unions, either positional arrays (``array``: vLLM before its map change; every
field present) or maps keyed by field name with the tag under ``"type"`` (``map``: newer vLLM; fields
at their default omitted, as msgspec's ``omit_defaults`` does). The last ``buffer_steps`` batches stay
in memory: a DEALER sending ``[b"", start_seq]`` to the replay socket gets every buffered batch with ``seq >=
start_seq`` and then the end marker (seq -1). Encoding, sending and replay run on one background
thread, so publishing from the event loop never blocks. Data-parallel rank ``r`` offsets both ports
by ``r`` and stamps ``data_parallel_rank`` on its batches.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

import msgspec
import structlog
import zmq

from epp.dev.sim.block_hash import external_hash
from epp.dev.sim.kvcache import AllCleared, BlocksRemoved, BlocksStored, KVEvent

log = structlog.get_logger("epp.sim")

ENCODINGS = ("array", "map")
DEFAULT_ENCODING = "map"

REPLAY_FORMATS = ("topic", "legacy")
"""Replay replies ``[b"", topic, seq, payload]`` (vLLM since it added the topic) or the older
``[b"", seq, payload]``."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)

MEDIUM_GPU = "GPU"

SPEC_KIND_FULL_ATTENTION = "full_attention"

_POLL_SECONDS = 0.05

FAULT_DROP = "drop"
FAULT_CORRUPT = "corrupt"

CORRUPT_PAYLOAD = b"\xc1not-msgpack"
"""What a corrupted batch carries on PUB: 0xc1 is the one byte msgpack never uses."""


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``KVEventsConfig``), as JSON on the command line.

    ``topic`` ``None`` (not given) means the simulator's default ``kv@<pod>@<model>``, the llm-d
    deployment convention; real vLLM's default topic is ``""``.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str | None = None

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events-config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv-events-config: {name} must be >= 1")
        if self.hwm < 0:
            raise ValueError("kv-events-config: hwm must be >= 0")
        if not self.endpoint:
            raise ValueError("kv-events-config: endpoint must not be empty")

    @property
    def enabled(self) -> bool:
        """Events are published (vLLM publishes only when enabled and the publisher is ``zmq``)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the JSON object of ``--kv-events-config``; errors name the field and the reason."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv-events-config: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("kv-events-config: must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"kv-events-config: unknown field(s) {unknown}; known: {', '.join(known)}")
        for name, value in data.items():
            _check_type(name, value)
        return cls(**data)


_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "enable_kv_cache_events": ((bool,), "a boolean", False),
    "publisher": ((str,), "a string", True),
    "endpoint": ((str,), "a string", False),
    "replay_endpoint": ((str,), "a string", True),
    "buffer_steps": ((int,), "an integer", False),
    "hwm": ((int,), "an integer", False),
    "max_queue_size": ((int,), "an integer", False),
    "topic": ((str,), "a string", True),
}


def _check_type(name: str, value: Any) -> None:
    types, what, nullable = _FIELD_TYPES[name]
    if value is None and nullable:
        return
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"kv-events-config: {name} must be {what}, got {value!r}")
    if not isinstance(value, types):
        raise ValueError(f"kv-events-config: {name} must be {what}, got {value!r}")


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A rank's endpoint, as vLLM derives it: the TCP port plus the rank (``inproc``: a suffix).

    A wildcard port (``tcp://host:*``, the simulator's extension) stays a wildcard.
    """
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" not in endpoint:
        raise ValueError(f"invalid KV events endpoint {endpoint!r}: must be tcp:// or inproc://")
    base, sep, port = endpoint.rpartition(":")
    if not sep or port == "*":
        return endpoint
    try:
        return f"{base}:{int(port) + rank}"
    except ValueError:
        raise ValueError(f"invalid KV events endpoint {endpoint!r}: bad port {port!r}") from None


def on_host(endpoint: str, host: str | None) -> str:
    """A wildcard ``tcp://*:N`` socket bound on ``host`` only (the simulator's ``--host``), unless
    ``host`` is itself a wildcard; vLLM binds every interface there."""
    if not host or host in ("0.0.0.0", "::", "*") or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint.removeprefix('tcp://*:')}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ``ipc://`` or ``inproc://`` endpoint, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# ---------------------------------------------------------------------------------------------- wire types

_STORED_FIELDS: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("block_hashes", list[int | bytes]),
    ("parent_block_hash", int | bytes | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[tuple[str, ...] | None] | None, None),
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
]
_REMOVED_FIELDS: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("block_hashes", list[int | bytes]),
    ("medium", str | None),
    ("group_idx", int | None, None),
]


def _event_types(array_like: bool) -> tuple[Any, Any, Any]:
    options: dict[str, Any] = {"array_like": array_like, "omit_defaults": True, "gc": False}
    return (
        msgspec.defstruct("BlockStored", _STORED_FIELDS, tag="BlockStored", **options),
        msgspec.defstruct("BlockRemoved", _REMOVED_FIELDS, tag="BlockRemoved", **options),
        msgspec.defstruct("AllBlocksCleared", [], tag="AllBlocksCleared", **options),
    )


_EVENT_TYPES = {"array": _event_types(True), "map": _event_types(False)}


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``EventBatch``: always positional, ``data_parallel_rank`` omitted when ``None``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def encode_batch(
    events: Sequence[KVEvent],
    *,
    block_size: int,
    encoding: str = DEFAULT_ENCODING,
    int_hashes: bool = True,
    data_parallel_rank: int | None = 0,
    ts: float | None = None,
    encoder: msgspec.msgpack.Encoder | None = None,
) -> bytes:
    """The msgpack payload of one batch of the cache's events, as vLLM's msgspec encoder writes it."""
    stored_type, removed_type, cleared_type = _EVENT_TYPES[encoding]
    wire: list[Any] = []
    for event in events:
        if isinstance(event, BlocksStored):
            wire.append(
                stored_type(
                    block_hashes=[external_hash(h, as_int=int_hashes) for h in event.hashes],
                    parent_block_hash=(
                        None if event.parent is None else external_hash(event.parent, as_int=int_hashes)
                    ),
                    token_ids=event.token_ids,
                    block_size=block_size,
                    lora_id=event.lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=event.lora_name,
                    extra_keys=event.extra_keys,
                    group_idx=0,
                    kv_cache_spec_kind=SPEC_KIND_FULL_ATTENTION,
                )
            )
        elif isinstance(event, BlocksRemoved):
            wire.append(
                removed_type(
                    block_hashes=[external_hash(h, as_int=int_hashes) for h in event.hashes],
                    medium=MEDIUM_GPU,
                    group_idx=0,
                )
            )
        elif isinstance(event, AllCleared):
            wire.append(cleared_type())
    batch = EventBatch(
        ts=time.time() if ts is None else ts, events=wire, data_parallel_rank=data_parallel_rank
    )
    return (encoder or msgspec.msgpack.Encoder()).encode(batch)


# ---------------------------------------------------------------------------------------------- publisher


@dataclass(slots=True, frozen=True)
class _Pending:
    ts: float
    events: list[KVEvent]
    fault: str | None


class ZmqEventPublisher:
    """vLLM's ``ZmqEventPublisher``: PUB socket, replay buffer and ROUTER replay socket on one thread.

    Sockets are bound (or connected) in the constructor, so a bad endpoint fails at start-up; the
    thread owns them afterwards. :meth:`publish` never blocks: a full queue drops the batch (logged
    and counted in ``queue_overflows``). Two simulator-only faults act on the next batches, which get
    their sequence numbers and enter the replay buffer as usual: :meth:`drop_next` does not send them
    on PUB (subscribers see a gap), :meth:`corrupt_next` sends ``CORRUPT_PAYLOAD`` instead of their
    payload (subscribers get a malformed message); replay returns the real batches.
    """

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        topic: str,
        block_size: int,
        data_parallel_rank: int = 0,
        encoding: str = DEFAULT_ENCODING,
        int_hashes: bool = True,
        replay_format: str = "topic",
        listen_host: str | None = None,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"KV events encoding must be one of {', '.join(ENCODINGS)}")
        if replay_format not in REPLAY_FORMATS:
            raise ValueError(f"KV events replay format must be one of {', '.join(REPLAY_FORMATS)}")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.queue_overflows = 0
        self._topic = topic.encode()
        self._block_size = block_size
        self._encoding = encoding
        self._int_hashes = int_hashes
        self._replay_format = replay_format
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._fault_lock = threading.Lock()
        self._faults: deque[str] = deque()
        self._sent = 0
        self._running = True
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
            assert endpoint is not None
            if binds(endpoint):
                self._pub.bind(on_host(endpoint, listen_host))
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            replay = offset_endpoint(config.replay_endpoint, data_parallel_rank)
            self.replay_endpoint: str | None = None
            if replay is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(on_host(replay, listen_host))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(
                f"KV events socket ({config.endpoint}, replay {config.replay_endpoint}): {exc}"
            ) from None
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"sim-kv-events-{data_parallel_rank}"
        )
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (never blocks); it gets the next sequence number when the thread sends it."""
        if not self._running or not events:
            return
        fault = None
        if self._faults:
            with self._fault_lock:
                if self._faults:
                    fault = self._faults.popleft()
        try:
            self._queue.put_nowait(_Pending(time.time(), events, fault))
        except queue.Full:
            self.queue_overflows += 1
            log.warning("sim.kv_events.queue_full", dropped_events=len(events))

    def drop_next(self, count: int) -> int:
        """Withhold the next ``count`` batches from PUB (they are still buffered for replay); returns
        how many batches have a fault pending."""
        return self._add_faults(FAULT_DROP, count)

    def corrupt_next(self, count: int) -> int:
        """Send ``CORRUPT_PAYLOAD`` on PUB for the next ``count`` batches (replay has the real ones)."""
        return self._add_faults(FAULT_CORRUPT, count)

    def _add_faults(self, fault: str, count: int) -> int:
        with self._fault_lock:
            self._faults.extend([fault] * count)
            return len(self._faults)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch sent will get."""
        return self._sent

    @property
    def idle(self) -> bool:
        """Every batch published so far has been sent (or withheld) and buffered."""
        return self._queue.unfinished_tasks == 0

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread and close the sockets (blocking, up to ``timeout``)."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("sim.kv_events.close_timeout", queued=self._queue.qsize())
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    # ------------------------------------------------------------------ thread side

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = count()
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                pending = self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            if pending is None:
                self._queue.task_done()
                break
            try:
                payload = encode_batch(
                    pending.events,
                    block_size=self._block_size,
                    encoding=self._encoding,
                    int_hashes=self._int_hashes,
                    data_parallel_rank=self.data_parallel_rank,
                    ts=pending.ts,
                    encoder=encoder,
                )
                seq = next(seqs)
                if pending.fault is None:
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                elif pending.fault == FAULT_CORRUPT:
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), CORRUPT_PAYLOAD))
                self._buffer.append((seq, payload))
                self._sent = seq + 1
            except Exception:
                log.exception("sim.kv_events.publish_failed")
            finally:
                self._queue.task_done()

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            try:
                frames = self._replay.recv_multipart()
                if len(frames) != 3:
                    log.warning("sim.kv_events.bad_replay_request", frames=len(frames))
                    continue
                client, _, start_bytes = frames
                start = int.from_bytes(start_bytes, "big")
                head = (client, b"", self._topic) if self._replay_format == "topic" else (client, b"")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
                end_head = (client, b"", b"") if self._replay_format == "topic" else (client, b"")
                self._replay.send_multipart((*end_head, END_SEQ, b""))
            except Exception:
                log.exception("sim.kv_events.replay_failed")

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
