"""The simulated vLLM engine: admission, FIFO waiting queue, running slots, token timing and counters.

This module knows nothing about HTTP. A request is admitted with :meth:`Engine.submit` (which raises
:class:`QueueFullError` when the waiting queue is at its cap), then :meth:`Engine.tokens` waits for a
running slot, simulates prefill (time to first token) and decode (inter-token latency) and yields the
generated tokens. :meth:`Engine.abort` releases whatever the request holds (queue place or running slot)
and is idempotent, so callers put it in a ``finally`` and client disconnects never leak a slot.

Metrics are not stored separately: :meth:`Engine.snapshot` reads the real current state, so what
``/metrics`` reports is exactly what the engine is doing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4
"""Token estimate used for prompts given as text: about four characters per token."""

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)

_VOCABULARY = (
    "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
    " A", " simulated", " model", " server", " answers", " every", " request", " politely", ",",
)  # fmt: skip


@dataclass(slots=True)
class SimConfig:
    """Every option of the simulator, with the defaults of the ``epp sim`` flags.

    Durations are in milliseconds and are multiplied by ``time_scale`` before use.
    """

    port: int = 8000
    host: str = "127.0.0.1"
    model: str = "demo"
    served_model_names: tuple[str, ...] = ()
    name: str | None = None
    namespace: str = "default"
    max_num_seqs: int = 5
    max_waiting: int = 1000
    time_to_first_token: float = 10.0
    inter_token_latency: float = 2.0
    max_tokens: int = 16
    kv_cache_size: int = 1024
    block_size: int = 16
    max_loras: int = 1
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        self.served_model_names = tuple(self.served_model_names)
        _require(0 <= self.port <= 65535, "port must be in 0..65535")
        _require(bool(self.model), "model must not be empty")
        for name in ("max_num_seqs", "max_tokens", "kv_cache_size", "block_size"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        for name in ("max_waiting", "max_loras", "time_to_first_token", "inter_token_latency", "time_scale"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the server answers to: the model first, then the extra served names."""
        return tuple(dict.fromkeys((self.model, *self.served_model_names)))

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens fit in the simulated KV cache."""
        return self.kv_cache_size * self.block_size

    def pod_name(self, port: int) -> str:
        """The pod name reported in response headers (``sim-<port>`` unless ``name`` is set)."""
        return self.name or f"sim-{port}"

    def delay_seconds(self, milliseconds: float) -> float:
        """A configured delay in milliseconds, scaled by ``time_scale``, in seconds."""
        return milliseconds * self.time_scale / 1000.0


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def estimate_tokens(text: str) -> int:
    """Approximate token count of a text (four characters per token, rounded up)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def token_text(index: int) -> str:
    """The deterministic text of the ``index``-th generated token."""
    return _VOCABULARY[index % len(_VOCABULARY)]


class QueueFullError(Exception):
    """The waiting queue is at ``max_waiting``: the request is rejected (HTTP 429)."""


class SeqState(enum.Enum):
    """Lifecycle of a request inside the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """What the engine needs to know about an inference request."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int | None = None
    """The client's output limit; ``None`` means the configured default length, finishing with ``stop``."""


@dataclass(slots=True, eq=False)
class Sequence:
    """A request admitted into the engine, with its live progress."""

    spec: RequestSpec
    output_tokens: int
    finish_reason: str
    state: SeqState = SeqState.WAITING
    generated_tokens: int = 0
    cached_tokens: int = 0
    granted: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def kv_tokens(self) -> int:
        """Tokens this request holds in the KV cache (only while running)."""
        if self.state is not SeqState.RUNNING:
            return 0
        return self.spec.prompt_tokens + self.generated_tokens


@dataclass(slots=True, frozen=True)
class Token:
    """One generated token; ``finish_reason`` is set on the last one."""

    index: int
    text: str
    finish_reason: str | None = None


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters, as exposed by vLLM's ``*_total`` metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def copy(self) -> EngineCounters:
        return dataclasses.replace(self, request_success=dict(self.request_success))


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """The engine's state at one instant, for metrics and tests."""

    running: int
    waiting: int
    kv_cache_usage: float
    running_lora_adapters: tuple[str, ...]
    waiting_lora_adapters: tuple[str, ...]
    counters: EngineCounters
    timestamp: float


class Engine:
    """At most ``max_num_seqs`` requests run at once; the others wait in FIFO order."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._running: dict[Sequence, None] = {}  # insertion-ordered set
        self._waiting: deque[Sequence] = deque()
        self._counters = EngineCounters()

    def submit(self, spec: RequestSpec) -> Sequence:
        """Admit a request: it runs at once if a slot is free, else it queues.

        Raises :class:`QueueFullError` when it would have to wait and the queue is full.
        """
        # Requests only wait while every slot is busy, so a full running set means this one would wait.
        if len(self._running) >= self.config.max_num_seqs and len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        seq = Sequence(spec=spec, output_tokens=self._output_tokens(spec), finish_reason=_finish_reason(spec))
        seq.granted = asyncio.get_running_loop().create_future()
        self._waiting.append(seq)
        self._schedule()
        return seq

    async def tokens(self, seq: Sequence) -> AsyncGenerator[Token, None]:
        """Wait for a running slot, then yield the generated tokens with simulated timing."""
        try:
            if seq.granted is not None:
                await seq.granted
            await asyncio.sleep(self.config.delay_seconds(self.config.time_to_first_token))
            self._counters.prompt_tokens += seq.spec.prompt_tokens
            for index in range(seq.output_tokens):
                if index:
                    await asyncio.sleep(self.config.delay_seconds(self.config.inter_token_latency))
                seq.generated_tokens += 1
                self._counters.generation_tokens += 1
                last = index == seq.output_tokens - 1
                yield Token(
                    index=index, text=token_text(index), finish_reason=seq.finish_reason if last else None
                )
            self._finish(seq)
        finally:
            self.abort(seq)

    def abort(self, seq: Sequence) -> None:
        """Release the queue place or running slot of a request; a no-op once it has finished."""
        self._release(seq)

    def snapshot(self) -> EngineSnapshot:
        """The real current state: queue lengths, KV usage and counters."""
        kv_tokens = sum(seq.kv_tokens for seq in self._running)
        return EngineSnapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=min(1.0, kv_tokens / self.config.kv_capacity_tokens),
            running_lora_adapters=(),
            waiting_lora_adapters=(),
            counters=self._counters.copy(),
            timestamp=time.time(),
        )

    def _output_tokens(self, spec: RequestSpec) -> int:
        return spec.max_tokens if spec.max_tokens is not None else self.config.max_tokens

    def _schedule(self) -> None:
        """Move waiting requests to running, in FIFO order, while slots are free."""
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting.popleft()
            seq.state = SeqState.RUNNING
            self._running[seq] = None
            self._counters.prefix_cache_queries += seq.spec.prompt_tokens
            self._counters.prefix_cache_hits += seq.cached_tokens
            if seq.granted is not None and not seq.granted.done():
                seq.granted.set_result(None)

    def _finish(self, seq: Sequence) -> None:
        if seq.state is not SeqState.RUNNING:
            return
        self._counters.request_success[seq.finish_reason] += 1
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.state is SeqState.WAITING:
            self._waiting.remove(seq)
        elif seq.state is SeqState.RUNNING:
            del self._running[seq]
        else:
            return
        seq.state = SeqState.FINISHED
        if seq.granted is not None and not seq.granted.done():
            seq.granted.cancel()
        self._schedule()


def _finish_reason(spec: RequestSpec) -> str:
    """Hitting the client's own limit is ``length``; the default-length answer ends with ``stop``."""
    return FINISH_LENGTH if spec.max_tokens is not None else FINISH_STOP
