"""``precise-prefix-cache-producer``: which endpoints hold the prompt's blocks, from their KV events.

The engines publish KV events (``epp.kvevents``); a background thread, started when ``epp serve``
starts serving, keeps the KV-block index (``epp.kvcache``) of what each endpoint really holds.
Per request the tokenized prompt (``token-producer``) becomes block keys, matched against the
index: ``PrefixCacheMatchInfo`` per candidate, its ``match_blocks`` the tier-weighted length of the
endpoint's contiguous match. PreRequest adds speculative entries for the picked endpoints
(``speculativeIndexing``). Subscriptions follow the endpoint store (and endpoint events when the
plugin is an extractor of an ``endpoint-notification-source``). Stores that the engines label with
a ``session_id`` fill ``sessions`` (which endpoints hold each session's blocks), read by
``session-affinity-scorer`` / ``-filter`` through ``sessionIdConfig.kvEventsProducerName``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from epp.framework import (
    CycleState,
    DataProducer,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    SchedulingResult,
    register,
)
from epp.framework.attributes import (
    PREFIX_CACHE_MATCH_INFO_KEY,
    TOKENIZED_PROMPT_KEY,
    PrefixCacheMatchInfo,
    TokenizedPrompt,
)
from epp.framework.durations import parse_go_duration
from epp.framework.endpoint import KV_EVENTS_PORT_LABEL, KV_EVENTS_REPLAY_PORT_LABEL
from epp.framework.interfaces import EndpointEvent, EventType, Plugin
from epp.framework.params import OMIT_UNSET
from epp.kvcache import (
    HASH_ALGORITHMS,
    BlockKeyer,
    KVBlockIndex,
    PrefixKeyCache,
    SessionResidency,
    block_extras,
)
from epp.kvevents import EventApplier, KVEventsIngester, Target
from epp.kvevents import metrics as kv_metrics
from epp.plugins.producers import _prefix_metrics

__all__ = ["PrecisePrefixCacheParams", "PrecisePrefixCacheProducer"]

log = structlog.get_logger("epp.plugins.precise_prefix_cache")

DEFAULT_BLOCK_SIZE_TOKENS = 16
DEFAULT_SPECULATIVE_TTL = 2.0
_DEFAULT_TTL_TEXT = "2s"  # DEFAULT_SPECULATIVE_TTL as written in a configuration
_DEFAULT_HASH_ALGORITHM = "cbor-fnv"
DEFAULT_POD_SELECTOR = "llm-d.ai/inference-serving=true"
PREFILL_PROFILE = "prefill"
_ENGINES = ("vllm", "sglang")
_NOT_SUPPORTED = "not supported: epp's KV-block index is in memory only (configure inMemoryConfig)"


@dataclass(slots=True, frozen=True)
class TokenProcessorConfig:
    block_size_tokens: int = 0  # 0: blockSize, else 16
    block_size: int = field(default=0, metadata=OMIT_UNSET)  # deprecated spelling of blockSizeTokens
    hash_seed: str = ""
    hash_algorithm: str = _DEFAULT_HASH_ALGORITHM  # "" is accepted as the same

    def effective(self) -> TokenProcessorConfig:
        """With the block size and hash algorithm used."""
        return TokenProcessorConfig(
            self.effective_block_size, 0, self.hash_seed, self.hash_algorithm or _DEFAULT_HASH_ALGORITHM
        )

    @property
    def effective_block_size(self) -> int:
        return self.block_size_tokens or self.block_size or DEFAULT_BLOCK_SIZE_TOKENS

    def validate(self) -> str | None:
        if self.block_size_tokens < 0:
            return f"blockSizeTokens: must be greater than 0, got {self.block_size_tokens}"
        if self.block_size_tokens == 0 and self.block_size < 0:
            return f"blockSize: must be greater than 0, got {self.block_size}"
        if self.hash_algorithm not in ("", *HASH_ALGORITHMS):
            return (
                f'hashAlgorithm: unsupported hashAlgorithm "{self.hash_algorithm}": accepted values are '
                + " and ".join(f'"{a}"' for a in HASH_ALGORITHMS)
            )
        return None


@dataclass(slots=True, frozen=True)
class InMemoryConfig:
    size: int = 100_000_000
    pod_cache_size: int = 10

    def validate(self) -> str | None:
        if self.size <= 0:
            return f"size: must be greater than 0, got {self.size}"
        if self.pod_cache_size <= 0:
            return f"podCacheSize: must be greater than 0, got {self.pod_cache_size}"
        return None


@dataclass(slots=True, frozen=True)
class KVBlockIndexConfig:
    in_memory_config: InMemoryConfig = field(default_factory=InMemoryConfig)
    redis_config: dict[str, object] | None = field(default=None, metadata=OMIT_UNSET)  # refused
    cost_aware_memory_config: dict[str, object] | None = field(default=None, metadata=OMIT_UNSET)  # refused
    enable_metrics: bool = False
    metrics_logging_interval: int | str = 0  # a Go duration: nanoseconds, or a duration string

    @property
    def logging_interval(self) -> float:
        v = self.metrics_logging_interval
        if isinstance(v, str):
            return parse_go_duration(v) or 0.0
        return v / 1e9

    def validate(self) -> str | None:
        if self.redis_config is not None:
            return f"redisConfig: {_NOT_SUPPORTED}"
        if self.cost_aware_memory_config is not None:
            return f"costAwareMemoryConfig: {_NOT_SUPPORTED}"
        v = self.metrics_logging_interval
        if isinstance(v, str) and parse_go_duration(v) is None:
            return f'metricsLoggingInterval: invalid duration "{v}"'
        if (v if isinstance(v, int) else parse_go_duration(v) or 0.0) < 0:
            return "metricsLoggingInterval: must not be negative"
        return None


@dataclass(slots=True, frozen=True)
class BackendConfig:
    name: str = ""
    weight: float = 0.0

    def validate(self) -> str | None:
        if not self.name:
            return "name: must not be empty"
        if self.weight < 0:
            return f"weight: must not be negative, got {self.weight}"
        return None


_DEFAULT_BACKENDS = (BackendConfig("gpu", 1.0), BackendConfig("cpu", 0.8))


@dataclass(slots=True, frozen=True)
class IndexerConfig:
    kv_block_index_config: KVBlockIndexConfig = field(default_factory=KVBlockIndexConfig)
    kv_cache_backend_configs: tuple[BackendConfig, ...] = _DEFAULT_BACKENDS
    tokenizers_pool_config: dict[str, object] | None = field(default=None, metadata=OMIT_UNSET)  # refused

    def validate(self) -> str | None:
        if self.tokenizers_pool_config is not None:
            return "tokenizersPoolConfig: not supported; configure a token-producer plugin instead"
        return None


@dataclass(slots=True, frozen=True)
class PodDiscoveryConfig:
    pod_label_selector: str = DEFAULT_POD_SELECTOR  # accepted; subscriptions follow the pool
    pod_namespace: str = field(default="", metadata=OMIT_UNSET)  # accepted; subscriptions follow the pool
    socket_port: int = 5557
    replay_socket_port: int = 0  # 0 (or negative): no replay

    def validate(self) -> str | None:
        if not 1 <= self.socket_port <= 65535:
            return f"socketPort: must be between 1 and 65535, got {self.socket_port}"
        if self.replay_socket_port > 65535:
            return f"replaySocketPort: must be at most 65535, got {self.replay_socket_port}"
        return None


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    zmq_endpoint: str = ""
    topic_filter: str = "kv@"
    concurrency: int = 4  # accepted: one ingestion thread serves every socket
    engine_type: str = "vllm"
    discover_pods: bool = True
    pod_discovery_config: PodDiscoveryConfig = field(default_factory=PodDiscoveryConfig)

    def validate(self) -> str | None:
        if self.concurrency <= 0:
            return f"concurrency: must be greater than 0, got {self.concurrency}"
        if self.engine_type not in ("", *_ENGINES):
            return f'engineType: unsupported engine type "{self.engine_type}" (supported: "vllm", "sglang")'
        if self.zmq_endpoint and "://" not in self.zmq_endpoint:
            return (
                f'zmqEndpoint: expected a ZMQ address such as "tcp://0.0.0.0:5557", got "{self.zmq_endpoint}"'
            )
        return None


@dataclass(slots=True, frozen=True)
class PrecisePrefixCacheParams:
    """Parameters of ``precise-prefix-cache-producer`` (the reference's nested shape)."""

    token_processor_config: TokenProcessorConfig = field(default_factory=TokenProcessorConfig)
    indexer_config: IndexerConfig = field(default_factory=IndexerConfig)
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    speculative_indexing: bool = False
    speculative_ttl: str = field(default=_DEFAULT_TTL_TEXT, metadata={"key": "speculativeTTL"})  # <= 0: 2s

    def effective(self) -> PrecisePrefixCacheParams:
        """With the speculative-entry lifetime used (empty or ≤ 0 means the default)."""
        ttl = parse_go_duration(self.speculative_ttl) if self.speculative_ttl else None
        if ttl is not None and ttl > 0:
            return self
        return dataclasses.replace(self, speculative_ttl=_DEFAULT_TTL_TEXT)

    @property
    def speculative_ttl_seconds(self) -> float:
        ttl = parse_go_duration(self.speculative_ttl) if self.speculative_ttl else None
        return ttl if ttl is not None and ttl > 0 else DEFAULT_SPECULATIVE_TTL

    def validate(self) -> str | None:
        if self.speculative_ttl and parse_go_duration(self.speculative_ttl) is None:
            return f'speculativeTTL: invalid duration "{self.speculative_ttl}"'
        return None


_Predicted = tuple[int, dict[Endpoint, PrefixCacheMatchInfo]]  # prompt tokens, each endpoint's match


@register
class PrecisePrefixCacheProducer(DataProducer, PreRequest):
    """Produce matches the tokenized prompt against the KV-block index; PreRequest adds
    speculative entries; endpoint hooks keep the subscriptions; ``start_serving`` starts ingestion."""

    type_name = "precise-prefix-cache-producer"
    accepts = "endpoint-events"
    Params = PrecisePrefixCacheParams
    params: PrecisePrefixCacheParams
    consumes = frozenset({TOKENIZED_PROMPT_KEY})
    produces = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: PrecisePrefixCacheParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else PrecisePrefixCacheParams()
        super().__init__(name, params, handle)
        tp = params.token_processor_config
        self.block_size = tp.effective_block_size
        self.keyer = BlockKeyer(self.block_size, tp.hash_seed, tp.hash_algorithm)
        self._recent_keys = PrefixKeyCache(self.keyer)
        ic = params.indexer_config
        mem = ic.kv_block_index_config.in_memory_config
        weights = {b.name.lower(): b.weight for b in ic.kv_cache_backend_configs}
        self.index = KVBlockIndex(mem.size, mem.pod_cache_size, weights)
        self._metrics = ic.kv_block_index_config.enable_metrics
        if self._metrics:
            kv_metrics.track_index(self.index)
        self._log_every = ic.kv_block_index_config.logging_interval if self._metrics else 0.0
        self._next_log = 0.0
        self.sessions = SessionResidency()
        self.applier = EventApplier(self.index, self.keyer, self.sessions)
        ev = params.kv_events_config
        pd = ev.pod_discovery_config
        self.ingester = KVEventsIngester(
            self.applier,
            engine=ev.engine_type or "vllm",
            topic_filter=ev.topic_filter,
            socket_port=pd.socket_port,
            replay_port=max(0, pd.replay_socket_port),
            central_endpoint=ev.zmq_endpoint,
            on_tick=self._tick if self._log_every > 0 else None,
        )
        # Per-endpoint subscriptions: every endpoint of the pool, unless the central socket is
        # configured (then only endpoints handed over by an endpoint-notification-source).
        self._discover = ev.discover_pods
        self._follow_store = ev.discover_pods and not ev.zmq_endpoint
        self._wired: set[str] = set()
        self._speculative = params.speculative_indexing
        self._ttl = params.speculative_ttl_seconds
        self._state_key = f"{self.type_name}/{name}"
        self._predicted_key = f"{self.type_name}/{name}/predicted"
        self._predicted = _prefix_metrics.PredictedHits(name, self.type_name)
        self._warned = False
        self._down: set[str] = set()
        self._block_size_told: set[str] = set()

    # --- request path -------------------------------------------------------------------------

    def request_keys(self, request: LLMRequest, prompt: TokenizedPrompt) -> list[int]:
        """The prompt's block keys (namespaced by the target model when it is an adapter seen in
        events; multimodal identifiers and the cache salt mixed in as the engine does)."""
        ids = prompt.token_ids
        model = request.target_model
        namespace = model if model and model in self.applier.loras else ""
        extras = block_extras(len(ids), self.block_size, prompt.mm_hashes, request.body.cache_salt)
        if extras is None:
            return self._recent_keys.keys(ids, namespace)
        return self.keyer.keys(ids, namespace=namespace, extras=extras)

    def config_warnings(self, plugins: Mapping[str, Plugin]) -> Sequence[tuple[str, str]]:
        """Matching needs exact token ids: warn when every token producer only estimates them."""
        producers = [
            p for p in plugins.values() if isinstance(p, DataProducer) and TOKENIZED_PROMPT_KEY in p.produces
        ]
        if not producers or any(getattr(p, "exact_tokens", True) for p in producers):
            return ()
        names = ", ".join(f"'{p.name}'" for p in producers)
        return (
            (
                "",
                f"the token producer ({names}) only estimates token ids, so only requests that carry "
                "their token ids get a prefix match (the others are routed as if no endpoint held "
                "their prefix): give the token-producer a tokenizer (`local: {path: <tokenizer "
                "directory>}`, or `modelName` with `vllm: {url: <render server>}`)",
            ),
        )

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        prompt = request.body.tokenized
        if prompt is None or not prompt.exact:
            if not self._warned:
                self._warned = True
                log.warning(
                    "precise-prefix-cache-producer needs the exact token ids of a token-producer; "
                    "requests without them get no prefix match",
                    plugin=self.name,
                    reason="no tokenized prompt" if prompt is None else "estimated token ids",
                )
            return
        keys = self.request_keys(request, prompt)
        if not keys:
            return
        start = time.perf_counter() if self._metrics else 0.0
        matches = self.index.match(keys, self._serving(endpoints))
        if self._metrics:
            kv_metrics.LOOKUP_LATENCY.observe(time.perf_counter() - start)
        total, bs = len(keys), self.block_size
        zero = PrefixCacheMatchInfo(0, total, bs)
        infos = dict.fromkeys(endpoints, zero)
        if matches:
            for e in endpoints:
                m = matches.get(e.metadata.key)
                if m is not None:
                    infos[e] = PrefixCacheMatchInfo(int(m.score + 1e-9), total, bs)  # 0.8 * 5 is 4
        cycle[PREFIX_CACHE_MATCH_INFO_KEY] = infos
        cycle[self._predicted_key] = (len(prompt.token_ids), infos)
        if self._speculative:
            cycle[self._state_key] = keys

    def _serving(self, endpoints: list[Endpoint]) -> list[str]:
        """The keys of the endpoints whose server is not down and whose event stream is trusted (a
        dead or restarted engine's blocks attract nothing); a change either way is handed to
        ingestion (a returning engine may have restarted)."""
        keys: list[str] = []
        down = self._down
        for e in endpoints:
            key = e.metadata.key
            engine_bs = e.metrics.cache_block_size
            if engine_bs and engine_bs != self.block_size and key not in self._block_size_told:
                self._block_size_told.add(key)
                log.warning(
                    "precise-prefix-cache-producer: the engine's KV-cache block size differs from "
                    "tokenProcessorConfig.blockSizeTokens, so its blocks match no request: set them equal "
                    "(vLLM's --block-size; its CPU backend defaults to 128)",
                    plugin=self.name,
                    endpoint=key,
                    engine_block_size=engine_bs,
                    block_size_tokens=self.block_size,
                )
            if e.metrics.down:
                if key not in down:
                    down.add(key)
                    self.ingester.endpoint_down(key, True)
                continue
            if key in down:
                down.discard(key)
                self.ingester.endpoint_down(key, False)
            if not self.ingester.trusted(key):
                continue  # its stream is back but not yet checked for a restart
            keys.append(key)
        return keys

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        keys: list[int] | None = cycle.pop(self._state_key, None)
        predicted: _Predicted | None = cycle.pop(self._predicted_key, None)
        primary = result.primary
        if predicted is not None and primary is not None and primary.target_endpoints:
            prompt_tokens, infos = predicted
            info = infos.get(primary.target_endpoints[0])
            cached = info.match_blocks * info.block_size_tokens if info is not None else 0
            self._predicted.record(cached, prompt_tokens)
        now = time.monotonic()
        self.index.expire(now)
        if not keys:
            return
        if primary is None or not primary.target_endpoints:
            return
        expires = now + self._ttl
        target = primary.target_endpoints[0].metadata.key
        self.index.add_speculative(target, keys, expires)
        prefill = result.profile_results.get(PREFILL_PROFILE)
        if prefill is not None and prefill.target_endpoints:
            pk = prefill.target_endpoints[0].metadata.key
            if pk != target:
                self.index.add_speculative(pk, keys, expires)

    # --- endpoints ----------------------------------------------------------------------------

    def _target(self, endpoint: Endpoint) -> Target:
        md = endpoint.metadata
        return Target(
            md.key,
            md.address,
            md.port,
            md.name,
            md.pod_name,
            md.rank,
            events_port=_label_port(md.labels, KV_EVENTS_PORT_LABEL),
            replay_port=_label_port(md.labels, KV_EVENTS_REPLAY_PORT_LABEL),
        )

    def extract_metadata(self, endpoint: Endpoint) -> None:
        """The store added (or changed) an endpoint."""
        key = endpoint.metadata.key
        self.ingester.add_endpoint(self._target(endpoint), self._follow_store or key in self._wired)

    def extract_endpoint(self, event: EndpointEvent) -> None:
        """An endpoint event from an ``endpoint-notification-source``."""
        key = event.endpoint.metadata.key
        if event.type == EventType.DELETE:
            self.remove_endpoint(key)
            return
        if self._discover:
            self._wired.add(key)
        self.ingester.add_endpoint(self._target(event.endpoint), self._discover)

    def remove_endpoint(self, key: str) -> None:
        """The endpoint left: unsubscribe and forget what it held."""
        self._wired.discard(key)
        self._down.discard(key)
        self._block_size_told.discard(key)
        self.ingester.remove_endpoint(key)
        if not self.ingester.running:
            self.index.remove_pod(key)
            self.sessions.forget_pod(key)

    # --- serving lifecycle --------------------------------------------------------------------

    async def start_serving(self) -> None:
        self.ingester.start()
        log.info(
            "precise prefix cache: KV-event ingestion started",
            plugin=self.name,
            central=self.params.kv_events_config.zmq_endpoint or None,
            per_endpoint=self._follow_store or None,
        )

    async def stop_serving(self) -> None:
        await asyncio.to_thread(self.ingester.stop)

    def _tick(self, now: float) -> None:
        if now < self._next_log:
            return
        self._next_log = now + self._log_every
        st = self.index.stats()
        log.info(
            "kv-block index",
            plugin=self.name,
            keys=st.keys,
            pods=st.pods,
            bytes=st.bytes,
            admissions=self.index.admissions,
            evictions=self.index.evictions,
            lookups=self.index.lookups,
            hits=self.index.lookup_hits,
            sessions=len(self.sessions),
            session_blocks=self.sessions.blocks,
        )


def _label_port(labels: Mapping[str, str], label: str) -> int:
    """The port an endpoint announces in ``label`` (0: none, or not a valid port)."""
    text = labels.get(label)
    if text is None:
        return 0
    if text.isdigit() and 0 < int(text) < 65536:
        return int(text)
    log.warning("kv_events.bad_port_label", label=label, value=text)
    return 0
