"""A minimal vLLM-style KV-event publisher for tests: XPUB (to see subscriptions) + ROUTER replay."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stored(
    hashes: list[int | bytes],
    tokens: list[int],
    parent: int | bytes | None = None,
    bs: int = 4,
    medium: str | None = None,
    lora: str | None = None,
) -> list[Any]:
    ev: list[Any] = ["BlockStored", hashes, parent, tokens, bs]
    if medium is not None or lora is not None:
        ev += [None, medium, lora]
    return ev


def removed(hashes: list[int | bytes], medium: str | None = None) -> list[Any]:
    return ["BlockRemoved", hashes] + ([medium] if medium is not None else [])


def batch(events: list[Any], *, encoding: str = "array", rank: int | None = None) -> bytes:
    if encoding == "map":
        names = {
            "BlockStored": (
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            ),
            "BlockRemoved": ("block_hashes", "medium"),
            "AllBlocksCleared": (),
        }
        evs = [{"type": e[0], **dict(zip(names[e[0]], e[1:], strict=False))} for e in events]
        return msgspec.msgpack.encode({"ts": time.time(), "events": evs, "data_parallel_rank": rank})
    body: list[Any] = [time.time(), events]
    if rank is not None:
        body.append(rank)
    return msgspec.msgpack.encode(body)


class Publisher:
    """Publishes ``[topic, seq, payload]``; ``replay_port`` serves the buffer like vLLM's ROUTER.

    ``replay_drops[i] = (first, end)``: answer ``i`` loses its messages ``first`` to ``end`` (``None``:
    all the rest, the end marker too), as vLLM's ROUTER does beyond its send high-water mark.
    ``replay_gate``: answers wait until it is set."""

    def __init__(
        self,
        port: int,
        *,
        topic: str = "kv@pod@m",
        replay_port: int = 0,
        connect: str = "",
        replay_drops: list[tuple[int, int | None]] | None = None,
        replay_gate: threading.Event | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription is reported
        if connect:
            self.pub.connect(connect)
        else:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.replay_drops = list(replay_drops or [])
        self.replay_gate = replay_gate
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_port:
            self._thread = threading.Thread(target=self._serve, args=(replay_port,), daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Until a subscription arrives (an unsubscription, ``\x00...``, does not count)."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000) + 1):
                raise AssertionError("no subscriber")
            if self.pub.recv()[:1] == b"\x01":
                return

    def send(self, payload: bytes, *, seq: int | None = None, publish: bool = True) -> int:
        n = self.seq if seq is None else seq
        self.seq = n + 1
        self.buffer.append((n, payload))
        if publish:
            self.pub.send_multipart([self.topic, n.to_bytes(8, "big"), payload])
        return n

    def raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self, port: int) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://127.0.0.1:{port}")
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            client, _, start_b = router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            answer = len(self.replay_requests)
            self.replay_requests.append(start)
            while self.replay_gate is not None and not self.replay_gate.wait(0.05):
                if self._stop.is_set():
                    break
            if self._stop.is_set():
                break
            first, end = self.replay_drops[answer] if answer < len(self.replay_drops) else (-1, -1)
            sent = [(n, p) for n, p in list(self.buffer) if n >= start]
            for i, (n, payload) in enumerate(sent):
                if first <= i and (end is None or i < end):
                    continue
                router.send_multipart([client, b"", n.to_bytes(8, "big"), payload])
            if end is not None:
                router.send_multipart([client, b"", END, b""])
        router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self.pub.close(0)
        self.ctx.term()


def wait(cond: Callable[[], object], timeout: float = 15.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.01)
