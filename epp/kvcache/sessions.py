"""Session residency: which endpoints hold blocks that a session's requests stored, from KV events.

vLLM and SGLang label a ``BlockStored`` with the ``session_id`` of the request behind the store.
Per endpoint an engine block hash keeps the sessions that stored it (at most ``MAX_LABELS``, the
newest kept); per session, per endpoint, the set of its engine hashes there. A session's blocks
leave with ``BlockRemoved`` (by engine hash) and with the endpoint's clear, so the residency
expires with the blocks. Bounded: a session unseen for ``ttl`` seconds is dropped (a sweep at most
every ``ttl / 10``), beyond ``max_sessions`` sessions or ``max_blocks`` labelled blocks the least
recently stored session goes first. Written by the ingestion thread, read on the request path:
one lock, held briefly.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_TTL",
    "MAX_LABELS",
    "MAX_SESSION_ID",
    "SessionResidency",
]

DEFAULT_MAX_SESSIONS = 100_000
DEFAULT_MAX_BLOCKS = 4_000_000
DEFAULT_TTL = 3600.0
MAX_LABELS = 8  # sessions remembered per engine block (a shared system prompt: the newest ones)
MAX_SESSION_ID = 1024  # characters; a longer label is ignored


class _Session:
    __slots__ = ("last", "pods")

    def __init__(self, now: float) -> None:
        self.last = now
        self.pods: dict[str, set[int]] = {}


class SessionResidency:
    """See the module docstring."""

    def __init__(
        self,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions <= 0 or max_blocks <= 0 or ttl <= 0:
            raise ValueError("max_sessions, max_blocks and ttl must be > 0")
        self.max_sessions = max_sessions
        self.max_blocks = max_blocks
        self.ttl = ttl
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently stored first
        self._labels: dict[str, dict[int, tuple[str, ...]]] = {}  # pod -> engine hash -> sessions
        self._blocks = 0  # (session, pod, hash) entries
        self._next_sweep = 0.0
        self._lock = threading.Lock()
        self.labelled = 0  # stores that carried a session id (a counter for tests and metrics)

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def blocks(self) -> int:
        return self._blocks

    # --- ingestion ------------------------------------------------------------------------------

    def stored(self, pod: str, session_id: str, engine_keys: Iterable[int]) -> None:
        """``session_id``'s request stored (or reused) ``engine_keys`` on ``pod``."""
        if not session_id or len(session_id) > MAX_SESSION_ID:
            return
        now = self._clock()
        with self._lock:
            self.labelled += 1
            if now >= self._next_sweep:
                self._sweep(now)
            sessions = self._sessions
            s = sessions.get(session_id)
            if s is None:
                s = sessions[session_id] = _Session(now)
            else:
                s.last = now
                sessions.move_to_end(session_id)
            held = s.pods.get(pod)
            if held is None:
                held = s.pods[pod] = set()
            labels = self._labels.setdefault(pod, {})
            for key in engine_keys:
                if key in held:
                    continue
                held.add(key)
                self._blocks += 1
                old = labels.get(key, ())
                if len(old) >= MAX_LABELS:
                    self._unlabel(old[0], pod, key)
                    old = old[1:]
                labels[key] = (*old, session_id)
            while len(sessions) > self.max_sessions or self._blocks > self.max_blocks:
                if len(sessions) == 1:
                    break
                self._drop(next(iter(sessions)))

    def removed(self, pod: str, engine_keys: Iterable[int]) -> None:
        """``pod`` evicted ``engine_keys``: the sessions that stored them no longer hold them there."""
        with self._lock:
            labels = self._labels.get(pod)
            if not labels:
                return
            for key in engine_keys:
                for session_id in labels.pop(key, ()):
                    self._unlabel(session_id, pod, key)

    def forget_pod(self, pod: str) -> None:
        """``pod`` was cleared or left: no session holds anything there."""
        with self._lock:
            labels = self._labels.pop(pod, None)
            if not labels:
                return
            for key, ids in labels.items():
                for session_id in ids:
                    self._unlabel(session_id, pod, key)

    def clear(self) -> None:
        with self._lock:
            self._sessions.clear()
            self._labels.clear()
            self._blocks = 0

    # --- request path ---------------------------------------------------------------------------

    def holders(self, session_id: str) -> dict[str, int]:
        """Per endpoint, how many blocks ``session_id``'s requests stored there and it still holds
        (empty for an unknown or expired session)."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                return {}
            if self._clock() - s.last > self.ttl:
                return {}
            return {pod: len(keys) for pod, keys in s.pods.items() if keys}

    # --- internals (lock held) ------------------------------------------------------------------

    def _unlabel(self, session_id: str, pod: str, key: int) -> None:
        s = self._sessions.get(session_id)
        if s is None:
            return
        held = s.pods.get(pod)
        if held is None or key not in held:
            return
        held.discard(key)
        self._blocks -= 1
        if not held:
            del s.pods[pod]
            if not s.pods:
                del self._sessions[session_id]

    def _drop(self, session_id: str) -> None:
        s = self._sessions.pop(session_id)
        for pod, keys in s.pods.items():
            self._blocks -= len(keys)
            labels = self._labels.get(pod)
            if labels is None:
                continue
            for key in keys:
                ids = labels.get(key)
                if ids is None:
                    continue
                rest = tuple(i for i in ids if i != session_id)
                if rest:
                    labels[key] = rest
                else:
                    del labels[key]
            if not labels:
                del self._labels[pod]

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + self.ttl / 10
        sessions, cutoff = self._sessions, now - self.ttl
        while sessions:
            session_id, s = next(iter(sessions.items()))
            if s.last >= cutoff:
                break
            self._drop(session_id)
