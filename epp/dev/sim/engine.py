"""The simulated vLLM engine: admission, FIFO waiting queue, running slots, KV cache, LoRA, timing."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field

from epp.dev.sim.block_hash import DEFAULT_HASH_ALGORITHM, HASH_ALGORITHMS, BlockHasher, seed_from_env
from epp.dev.sim.kv_events import (
    DEFAULT_ENCODING,
    ENCODINGS,
    LAYOUTS,
    REPLAY_FORMATS,
    KVEventsConfig,
    layout_of,
)
from epp.dev.sim.kvcache import Allocation, KVCache, KVEvent, PromptBlocks
from epp.dev.sim.latency import (
    ITL_BUCKETS,
    LORA_LOAD_BUCKETS,
    QUEUE_TIME_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    LatencyModel,
)
from epp.dev.sim.lora import FROM_DISK, FROM_HOST, LoraSlots
from epp.dev.sim.tokens import output_tokens, tokenizer_for
from epp.tokenization import Tokenizer

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)

ROLES = ("prefill-decode", "prefill", "decode", "both")  # both: the pre-v0.11 name of prefill-decode
FAILURE_TYPES = ("rate_limit", "server_error", "invalid_request", "model_not_found")
# a broken /metrics (inference keeps working): 500 answers, no answer at all, or a 200 of non-metrics text
METRICS_FAULTS = ("none", "error", "hang", "garbage")


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
    prefill_time_per_token: float = 0.05  # ms per uncached prompt token (~20k tokens/s of prefill)
    inter_token_latency: float = 2.0
    time_factor_under_load: float = 1.0
    time_to_first_token_std_dev: float = 0.0
    inter_token_latency_std_dev: float = 0.0
    max_tokens: int = 16
    max_model_len: int = 16_777_216  # tokens; large enough for any body the server accepts
    tokenizer: str = ""  # a HF tokenizer directory; "" is the one shipped with epp
    kv_cache_size: int = 1024
    block_size: int = 16
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    lora_load_time: float = 10.0
    max_cpu_loras: int = 0
    """Host (CPU) cache of adapters, GPU-resident ones included; 0: ``max_loras`` (vLLM's default)."""
    lora_host_load_time: float = 2.0
    """ms to copy an adapter from the host cache into a GPU slot (a cold load costs ``lora_load_time``)."""
    failure_injection_rate: float = 0.0
    failure_types: tuple[str, ...] = FAILURE_TYPES
    metrics_fault: str = "none"
    metrics_port: int = 0  # > 0: /metrics only on this port, not the serving port (Triton-like)
    dcgm_port: int = 0  # > 0: a DCGM-exporter-like GPU page on this port
    role: str = "prefill-decode"
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    seed: int | None = None
    time_scale: float = 1.0
    kv_events_config: KVEventsConfig | None = None
    """vLLM's ``--kv-events-config``; ``None`` or not enabled: no KV events."""
    kv_events_encoding: str = DEFAULT_ENCODING
    kv_events_layout: str = ""
    """An engine version's event layout and block hashing (``LAYOUTS``); "": the encoding's."""
    kv_events_replay_format: str = "topic"
    load_publish_port: int = 0
    """> 0: publish SGLang's ``LoadStat`` on this ZMQ PUB port (rank i: port + i)."""
    load_publish_interval_ms: float = 50.0
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGORITHM
    hash_seed: str | None = field(default_factory=seed_from_env)
    """vLLM's block-hash seed (``PYTHONHASHSEED``); ``None``: vLLM's default (fixed since 0.29)."""
    keep_alive: float = 5.0
    """Seconds an idle keep-alive connection stays open (vLLM's uvicorn: 5 s)."""
    enable_prompt_tokens_details: bool = False
    """``usage.prompt_tokens_details`` (cached tokens) in answers; ``null`` without, as vLLM."""
    enable_scale_out: bool = False
    """The render and token-in endpoints; without, they answer 403, as vLLM 0.32's."""

    def __post_init__(self) -> None:
        self.served_model_names = tuple(self.served_model_names)
        self.lora_modules = tuple(dict.fromkeys(self.lora_modules))
        self.failure_types = tuple(self.failure_types)
        _require(0 <= self.port <= 65535, "port must be in 0..65535")
        for name in ("metrics_port", "dcgm_port"):
            _require(0 <= getattr(self, name) <= 65535, f"{name} must be in 0..65535")
        _require(bool(self.model), "model must not be empty")
        for name in (
            "max_num_seqs",
            "max_tokens",
            "max_model_len",
            "kv_cache_size",
            "block_size",
            "data_parallel_size",
        ):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        for name in (
            "max_waiting",
            "max_loras",
            "time_to_first_token",
            "prefill_time_per_token",
            "inter_token_latency",
            "time_factor_under_load",
            "time_to_first_token_std_dev",
            "inter_token_latency_std_dev",
            "lora_load_time",
            "max_cpu_loras",
            "lora_host_load_time",
            "time_scale",
        ):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0")
        _require(0 <= self.failure_injection_rate <= 1, "failure_injection_rate must be in 0..1")
        _require(bool(self.failure_types), "failure_types must not be empty")
        unknown = sorted(set(self.failure_types) - set(FAILURE_TYPES))
        _require(not unknown, f"failure_types: unknown {unknown}; known: {', '.join(FAILURE_TYPES)}")
        _require(self.role in ROLES, f"role must be one of {', '.join(ROLES)}")
        _require(
            self.metrics_fault in METRICS_FAULTS, f"metrics_fault must be one of {', '.join(METRICS_FAULTS)}"
        )
        _require(not self.lora_modules or self.max_loras >= 1, "max_loras must be >= 1 with lora_modules")
        _require(
            self.max_cpu_loras == 0 or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras must be 0 (= max_loras) or >= max_loras",
        )
        clash = set(self.lora_modules) & set(self.model_names)
        _require(not clash, f"lora_modules must differ from the served model names: {sorted(clash)}")
        _require(self.port + self.data_parallel_size - 1 <= 65535, "data-parallel ports must be <= 65535")
        _require(self.data_parallel_rank >= 0, "data_parallel_rank must be >= 0")
        _require(
            self.prefix_caching_hash_algo in HASH_ALGORITHMS,
            f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGORITHMS)}",
        )
        _require(
            self.kv_events_encoding in ENCODINGS, f"kv_events_encoding must be one of {', '.join(ENCODINGS)}"
        )
        _require(
            not self.kv_events_layout or self.kv_events_layout in LAYOUTS,
            f"kv_events_layout must be one of {', '.join(LAYOUTS)}",
        )
        _require(
            self.kv_events_replay_format in REPLAY_FORMATS,
            f"kv_events_replay_format must be one of {', '.join(REPLAY_FORMATS)}",
        )

    @property
    def kv_events_enabled(self) -> bool:
        """The engine publishes vLLM KV events."""
        return self.kv_events_config is not None and self.kv_events_config.enabled

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every base-model name the server answers to: the model first, then the extra served names."""
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
    prompt: list[int] = field(default_factory=list)
    """The prompt's token ids; empty means unknown content, never cached."""
    remote_prefill: bool = False
    """The KV of the prompt comes from a remote prefill worker: no local prefill cost."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: an extra key of the first block's hash (so the whole chain)."""
    session_id: str | None = None
    """vLLM's ``session_id``: labels the KV events of the blocks the request stores."""

    @classmethod
    def of(
        cls,
        request_id: str,
        model: str,
        prompt: list[int],
        max_tokens: int | None = None,
        *,
        remote_prefill: bool = False,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> RequestSpec:
        """A spec whose prompt content is known (so prefix caching applies)."""
        return cls(request_id, model, len(prompt), max_tokens, prompt, remote_prefill, cache_salt, session_id)


@dataclass(slots=True, eq=False)
class Sequence:
    """A request admitted into the engine, with its live progress and its modelled timing."""

    spec: RequestSpec
    output_tokens: int
    finish_reason: str
    lora: str | None = None
    blocks: PromptBlocks = field(default_factory=PromptBlocks, repr=False)
    state: SeqState = SeqState.WAITING
    generated_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (``usage.prompt_tokens_details.cached_tokens``)."""
    uncached_tokens: int = 0
    """Prompt tokens whose prefill cost was paid locally."""
    ttft_ms: float = 0.0
    """Modelled time to first token (unscaled ms, LoRA load included), set when scheduled."""
    lora_load_ms: float = 0.0
    arrival: float = 0.0
    allocation: Allocation | None = field(default=None, repr=False)
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
    token_id: int = 0


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters, as exposed by vLLM's ``*_total`` metrics (prefix cache ones in tokens)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_kv_tokens: int = 0
    """Prompt tokens whose KV came from a remote prefill worker (not computed here)."""
    request_success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    request_queue_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    prompt_tokens_cached: int = 0
    # vLLM's request_latency_buckets (the queue time's) for the phases of finished requests
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    request_inference_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    request_prefill_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    request_decode_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    lora_adapter_load: Histogram = field(default_factory=lambda: Histogram(LORA_LOAD_BUCKETS))
    """Adapter loads into a GPU slot (from the host cache or cold), in seconds: its count is the loads."""

    def copy(self) -> EngineCounters:
        return dataclasses.replace(
            self,
            request_success=dict(self.request_success),
            time_to_first_token=self.time_to_first_token.copy(),
            inter_token_latency=self.inter_token_latency.copy(),
            request_queue_time=self.request_queue_time.copy(),
            e2e_request_latency=self.e2e_request_latency.copy(),
            request_inference_time=self.request_inference_time.copy(),
            request_prefill_time=self.request_prefill_time.copy(),
            request_decode_time=self.request_decode_time.copy(),
            lora_adapter_load=self.lora_adapter_load.copy(),
        )


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
    gpu_lora_adapters: tuple[str, ...] = ()
    """Adapters holding a GPU slot."""
    cpu_lora_adapters: tuple[str, ...] = ()
    """Adapters in the host cache only."""


@dataclass(slots=True, frozen=True)
class EnginePeaks:
    """Simulator-only: the highest queue length and batch size seen (no vLLM metric has them)."""

    waiting: int
    running: int


class Engine:
    """At most ``max_num_seqs`` requests run at once; the others wait in FIFO order.

    ``submit`` admits a request (``QueueFullError`` when it would wait and the queue is at its cap);
    ``tokens`` waits until it is scheduled, simulates prefill and decode and yields the tokens;
    ``abort`` releases whatever the request holds and is idempotent, so callers put it in a
    ``finally``. The head of the queue runs when a slot is free and its prompt gets KV blocks (else
    the queue waits); a request whose LoRA adapter cannot be loaded yet is skipped, as vLLM does.
    The time to first token is fixed when a request is scheduled, from its uncached prompt tokens
    and the batch size. ``snapshot`` reads the real current state, so ``/metrics`` reports exactly
    what the engine is doing; ``peaks`` keeps the longest queue and largest batch between two
    ``reset_peaks`` (exact, where a scrape of the gauges could miss a short burst).
    """

    def __init__(self, config: SimConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or tokenizer_for(config.tokenizer)
        self._output = output_tokens(self.tokenizer)
        self.kv = KVCache(
            config.kv_cache_size,
            config.block_size,
            BlockHasher(
                config.block_size,
                config.prefix_caching_hash_algo,
                config.hash_seed,
                layout_of(config.kv_events_layout, config.kv_events_encoding).vllm,
            ),
            record_events=config.kv_events_enabled,
        )
        self.kv_event_sink: Callable[[list[KVEvent]], None] | None = None
        """Receives each scheduling step's KV events (the publisher's ``publish``)."""
        self.loras = LoraSlots(config.max_loras, config.max_cpu_loras)
        self.latency = LatencyModel(
            time_to_first_token=config.time_to_first_token,
            prefill_time_per_token=config.prefill_time_per_token,
            inter_token_latency=config.inter_token_latency,
            time_factor_under_load=config.time_factor_under_load,
            max_num_seqs=config.max_num_seqs,
            time_to_first_token_std_dev=config.time_to_first_token_std_dev,
            inter_token_latency_std_dev=config.inter_token_latency_std_dev,
            rng=random.Random(config.seed),
        )
        self._running: dict[Sequence, None] = {}  # insertion-ordered set
        self._waiting: deque[Sequence] = deque()
        self._counters = EngineCounters()
        self._peak_waiting = 0
        self._peak_running = 0

    def submit(self, spec: RequestSpec) -> Sequence:
        """Admit a request: it runs at once if it can be scheduled, else it queues.

        Raises :class:`QueueFullError` when it would have to wait and the queue is full.
        """
        lora = spec.model if spec.model in self.config.lora_modules else None
        seq = Sequence(
            spec=spec,
            output_tokens=self._output_tokens(spec),
            finish_reason=_finish_reason(spec),
            lora=lora,
            blocks=self.kv.prompt_blocks(
                spec.prompt,
                lora_name=lora,
                lora_id=self.config.lora_modules.index(lora) + 1 if lora is not None else None,
                cache_salt=spec.cache_salt,
                session_id=spec.session_id,
            ),
        )
        loop = asyncio.get_running_loop()
        seq.arrival = loop.time()
        seq.granted = loop.create_future()
        self._waiting.append(seq)
        self._schedule()
        if seq.state is SeqState.WAITING and len(self._waiting) > self.config.max_waiting:
            self._waiting.remove(seq)
            seq.state = SeqState.FINISHED
            seq.granted.cancel()
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self._peak_waiting = max(self._peak_waiting, len(self._waiting))
        return seq

    async def tokens(self, seq: Sequence) -> AsyncGenerator[Token, None]:
        """Wait to be scheduled, then yield the generated tokens with simulated timing."""
        loop = asyncio.get_running_loop()
        try:
            if seq.granted is not None:
                await seq.granted
            scheduled = loop.time()
            await asyncio.sleep(self.config.delay_seconds(seq.ttft_ms))
            self._counters.prompt_tokens += seq.spec.prompt_tokens
            last = first = loop.time()
            self._counters.time_to_first_token.observe(last - seq.arrival)
            for index in range(seq.output_tokens):
                if index:
                    await asyncio.sleep(self.config.delay_seconds(self.latency.itl_ms(len(self._running))))
                    now = loop.time()
                    self._counters.inter_token_latency.observe(now - last)
                    last = now
                seq.generated_tokens += 1
                self._counters.generation_tokens += 1
                if seq.allocation is not None:
                    self.kv.grow(seq.allocation, seq.spec.prompt_tokens + seq.generated_tokens)
                    self._flush_kv_events()
                final = index == seq.output_tokens - 1
                token_id, text = self._output.at(index)
                yield Token(index, text, seq.finish_reason if final else None, token_id)
            self._observe_phases(seq.arrival, scheduled, first, loop.time())
            self._finish(seq)
        finally:
            self.abort(seq)

    def _observe_phases(self, arrival: float, scheduled: float, first: float, end: float) -> None:
        counters = self._counters
        counters.e2e_request_latency.observe(end - arrival)
        counters.request_inference_time.observe(end - scheduled)
        counters.request_prefill_time.observe(first - scheduled)
        counters.request_decode_time.observe(end - first)

    def abort(self, seq: Sequence) -> None:
        """Release the queue place or running slot of a request; a no-op once it has finished."""
        self._release(seq)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``/reset_prefix_cache``: forget every cached block, refused while requests hold blocks."""
        reset = self.kv.reset()
        self._flush_kv_events()
        return reset

    def _flush_kv_events(self) -> None:
        """Hand the KV events of this scheduling step to the sink, as one batch."""
        if not self.kv.record_events:
            return
        events = self.kv.take_events()
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)

    def snapshot(self) -> EngineSnapshot:
        """The real current state: queue lengths, KV usage, LoRA adapters and counters."""
        return EngineSnapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=min(1.0, self.kv.usage),
            running_lora_adapters=_adapters(self._running),
            waiting_lora_adapters=_adapters(self._waiting),
            counters=self._counters.copy(),
            timestamp=time.time(),
            gpu_lora_adapters=self.loras.loaded,
            cpu_lora_adapters=self.loras.host_only,
        )

    def peaks(self) -> EnginePeaks:
        """The longest waiting queue and the largest batch since start (or the last ``reset_peaks``)."""
        return EnginePeaks(waiting=self._peak_waiting, running=self._peak_running)

    def reset_peaks(self) -> EnginePeaks:
        """Start the peaks again from the current queue and batch; returns the peaks before."""
        before = self.peaks()
        self._peak_waiting, self._peak_running = len(self._waiting), len(self._running)
        return before

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    def _output_tokens(self, spec: RequestSpec) -> int:
        if spec.max_tokens is not None:
            return spec.max_tokens
        return max(1, min(self.config.max_tokens, self.config.max_model_len - spec.prompt_tokens))

    def _schedule(self) -> None:
        """Start waiting requests in FIFO order while slots and KV blocks allow.

        The queue stops at a request whose prompt does not fit in the KV cache; a request whose LoRA
        adapter cannot be loaded yet is passed over.
        """
        try:
            for seq in list(self._waiting):
                if len(self._running) >= self.config.max_num_seqs:
                    return
                if seq.lora is not None and not self.loras.can_acquire(seq.lora, self._busy_adapters()):
                    continue
                allocation = self.kv.allocate(seq.blocks, seq.spec.prompt_tokens)
                if allocation is None:
                    return
                source = self.loras.acquire(seq.lora, self._busy_adapters()) if seq.lora is not None else None
                self._start(seq, allocation, lora_source=source)
        finally:
            self._flush_kv_events()

    def _start(self, seq: Sequence, allocation: Allocation, *, lora_source: str | None) -> None:
        self._waiting.remove(seq)
        seq.state = SeqState.RUNNING
        seq.allocation = allocation
        self._running[seq] = None
        self._peak_running = max(self._peak_running, len(self._running))
        seq.cached_tokens = allocation.hit_tokens
        seq.uncached_tokens = 0 if seq.spec.remote_prefill else seq.spec.prompt_tokens - seq.cached_tokens
        seq.lora_load_ms = (
            self.config.lora_load_time
            if lora_source == FROM_DISK
            else self.config.lora_host_load_time
            if lora_source == FROM_HOST
            else 0.0
        )
        if lora_source in (FROM_DISK, FROM_HOST):
            self._counters.lora_adapter_load.observe(self.config.delay_seconds(seq.lora_load_ms))
        seq.ttft_ms = seq.lora_load_ms + self.latency.ttft_ms(seq.uncached_tokens, len(self._running))
        self._counters.prefix_cache_queries += seq.spec.prompt_tokens
        self._counters.prefix_cache_hits += seq.cached_tokens
        if seq.spec.remote_prefill:
            self._counters.external_kv_tokens += seq.spec.prompt_tokens - seq.cached_tokens
        self._counters.prompt_tokens_cached += seq.cached_tokens
        self._counters.request_queue_time.observe(asyncio.get_running_loop().time() - seq.arrival)
        if seq.granted is not None and not seq.granted.done():
            seq.granted.set_result(None)

    def _busy_adapters(self) -> set[str]:
        return {seq.lora for seq in self._running if seq.lora is not None}

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
            if seq.allocation is not None:
                self.kv.free(seq.allocation)
        else:
            return
        seq.state = SeqState.FINISHED
        if seq.granted is not None and not seq.granted.done():
            seq.granted.cancel()
        self._schedule()


def _adapters(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The distinct LoRA adapters of some sequences, in order of first appearance."""
    return tuple(dict.fromkeys(seq.lora for seq in seqs if seq.lora is not None))


def _finish_reason(spec: RequestSpec) -> str:
    """Hitting the client's own limit is ``length``; the default-length answer ends with ``stop``."""
    return FINISH_LENGTH if spec.max_tokens is not None else FINISH_STOP
