"""vLLM's KV-cache event publisher for the simulator: a ZMQ PUB socket plus a ROUTER replay socket.

Every batch goes out as ``[topic, seq (8 bytes big-endian), msgpack EventBatch]``; ``seq`` starts at 0
and grows by one per batch. The batch is msgspec's array form ``[ts, events, data_parallel_rank]``;
events are tagged unions in the layout of one engine version range (``LAYOUTS``: vLLM 0.10 to 0.34,
SGLang 0.5.1 to 0.5.23): positional arrays (vLLM <= 0.23, SGLang <= 0.5.19; every field present)
or maps keyed by field name with the tag under ``"type"`` (fields at their default omitted, as
msgspec's ``omit_defaults`` does). The last ``buffer_steps`` batches stay
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

from epp.dev.sim.block_hash import NEWEST_VLLM, VllmVersion, external_hash
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

_UINT64 = (1 << 64) - 1

FAULT_DROP = "drop"
FAULT_CORRUPT = "corrupt"

CORRUPT_PAYLOAD = b"\xc1not-msgpack"
"""What a corrupted batch carries on PUB: 0xc1 is the one byte msgpack never uses."""


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``KVEventsConfig``), as JSON on the command line.

    ``topic`` ``None`` (not given) means vLLM's default, ``""`` (no topic); the llm-d deployment
    convention sets ``kv@<pod>@<model>``, which a central EPP socket needs to name the endpoint.
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

_VLLM_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_VLLM_REMOVED = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_SGLANG_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "cache_salt",
    "session_id",
    "lora_name",
)
_SGLANG_REMOVED = ("block_hashes", "medium")
_REQUIRED = {"vllm": (7, 2), "sglang": (5, 1)}  # leading fields without a default (stored, removed)
_INT64 = 1 << 63


@dataclass(slots=True, frozen=True)
class Layout:
    """The KV-event wire layout of a range of engine versions: events as positional arrays (every
    field written) or maps (fields at their ``None`` default omitted), with the first ``stored``
    and ``removed`` fields of the engine's field list; ``salt_metadata``: SGLang's salted stores
    carry ``{"cache_salt": ...}`` after the fields. ``vllm`` is the vLLM version whose block
    hashing the simulator follows."""

    name: str
    engine: str
    maps: bool
    stored: int
    removed: int
    vllm: VllmVersion = NEWEST_VLLM
    salt_metadata: bool = False


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("vllm-0.10", "vllm", False, 5, 1, (0, 10)),  # lora_id only, no medium
        Layout("vllm-0.11", "vllm", False, 6, 2, (0, 11)),  # + medium; hashes int or bytes
        Layout("vllm-0.14", "vllm", False, 7, 2, (0, 14)),  # + lora_name
        Layout("vllm-0.17", "vllm", False, 8, 2, (0, 17)),  # + extra_keys
        Layout("vllm-0.20", "vllm", False, 9, 3, (0, 20)),  # + group_idx
        Layout("vllm-0.22", "vllm", False, 11, 3, (0, 22)),  # + kv_cache_spec_kind, _sliding_window
        Layout("vllm-0.24", "vllm", True, 11, 3, (0, 24)),  # events as maps
        Layout("vllm-0.27", "vllm", True, 12, 4, (0, 27)),  # + locality
        Layout("vllm-0.29", "vllm", True, 13, 5, (0, 29)),  # + ownership; fixed default seed
        Layout("vllm-0.30", "vllm", True, 14, 5, (0, 30)),  # + session_id
        Layout("vllm-0.31", "vllm", True, 14, 5, (0, 31)),  # tagged extra keys in the hash
        Layout("vllm-0.33", "vllm", True, 15, 5, (0, 33)),  # + lookahead_token_ids
        Layout("vllm-0.34", "vllm", True, 15, 5, (0, 34)),
        Layout("sglang-0.5.1", "sglang", False, 5, 1),
        Layout("sglang-0.5.9", "sglang", False, 6, 2),  # + medium
        Layout("sglang-0.5.18", "sglang", False, 6, 2, salt_metadata=True),  # salted: + metadata
        Layout("sglang-0.5.20", "sglang", True, 8, 2),  # maps; + cache_salt, session_id
        Layout("sglang-0.5.22", "sglang", True, 9, 2),  # + lora_name
    )
}
"""``--kv-events-layout`` values: each names the first version of its range."""

ENCODING_LAYOUTS = {"array": "vllm-0.22", "map": "vllm-0.34"}
"""The layout of each ``--kv-events-encoding`` (when no layout is given)."""


def layout_of(name: str, encoding: str = DEFAULT_ENCODING) -> Layout:
    """A layout by name ("" : the one of ``encoding``); ``ValueError`` names the known ones."""
    layout = LAYOUTS.get(name or ENCODING_LAYOUTS.get(encoding, ""))
    if layout is None:
        raise ValueError(f"unknown KV events layout {name!r}; known: {', '.join(LAYOUTS)}")
    return layout


def _sglang_hash(block_hash: bytes) -> int:
    """An SGLang block hash: a signed 64-bit int (the digest's low 64 bits)."""
    value = int.from_bytes(block_hash, "big") & _UINT64
    return value - (1 << 64) if value >= _INT64 else value


def _stored_fields(event: BlocksStored, layout: Layout, block_size: int, int_hashes: bool) -> list[Any]:
    if layout.engine == "sglang":
        parent = None if event.parent is None else _sglang_hash(event.parent)
        return [
            [_sglang_hash(h) for h in event.hashes],
            parent,
            event.token_ids,
            block_size,
            None,  # SGLang's adapters are namespaced inside its hashes, lora_id is never set
            MEDIUM_GPU,
            event.cache_salt,
            event.session_id,
            event.lora_name,
        ]
    return [
        [external_hash(h, as_int=int_hashes) for h in event.hashes],
        None if event.parent is None else external_hash(event.parent, as_int=int_hashes),
        event.token_ids,
        block_size,
        event.lora_id,
        MEDIUM_GPU,
        event.lora_name,
        event.extra_keys,
        0,
        SPEC_KIND_FULL_ATTENTION,
        None,
        None,
        None,
        event.session_id,
        None,
    ]


def _wire(tag: str, names: Sequence[str], values: Sequence[Any], required: int, layout: Layout) -> Any:
    if not layout.maps:
        return [tag, *values]
    event: dict[str, Any] = {"type": tag}
    for i, (name, value) in enumerate(zip(names, values, strict=True)):
        if value is not None or i < required:
            event[name] = value
    return event


def encode_batch(
    events: Sequence[KVEvent],
    *,
    block_size: int,
    encoding: str = DEFAULT_ENCODING,
    int_hashes: bool = True,
    data_parallel_rank: int | None = 0,
    ts: float | None = None,
    encoder: msgspec.msgpack.Encoder | None = None,
    layout: str = "",
) -> bytes:
    """The msgpack payload of one batch of the cache's events, as the engine of ``layout`` ("": the
    one of ``encoding``) writes it: ``[ts, events, rank]``."""
    lay = layout_of(layout, encoding)
    sglang = lay.engine == "sglang"
    stored_names = (_SGLANG_STORED if sglang else _VLLM_STORED)[: lay.stored]
    removed_names = (_SGLANG_REMOVED if sglang else _VLLM_REMOVED)[: lay.removed]
    need_stored, need_removed = _REQUIRED[lay.engine]
    wire: list[Any] = []
    for event in events:
        if isinstance(event, BlocksStored):
            values = _stored_fields(event, lay, block_size, int_hashes)[: lay.stored]
            item = _wire("BlockStored", stored_names, values, need_stored, lay)
            if lay.salt_metadata and event.cache_salt:
                item.append({"cache_salt": event.cache_salt})
            wire.append(item)
        elif isinstance(event, BlocksRemoved):
            removed = [
                [_sglang_hash(h) if sglang else external_hash(h, as_int=int_hashes) for h in event.hashes],
                MEDIUM_GPU,
                0,
                None,
                None,
            ][: lay.removed]
            wire.append(_wire("BlockRemoved", removed_names, removed, need_removed, lay))
        elif isinstance(event, AllCleared):
            wire.append(_wire("AllBlocksCleared", (), (), 0, lay))
    batch = [time.time() if ts is None else ts, wire, data_parallel_rank]
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
        layout: str = "",
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"KV events encoding must be one of {', '.join(ENCODINGS)}")
        self.layout = layout_of(layout, encoding).name
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
                    layout=self.layout,
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
