"""Endpoints as the scheduler sees them: one routable ``ip:port`` of a model server each."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from epp.framework.metrics_journal import JOURNAL

_EMPTY: Mapping[str, Any] = MappingProxyType({})

SCRAPE_CONNECT_FAILURE = "connect"
"""``Metrics.failure`` of a scrape whose connection was refused, reset or closed before a response:
no server is listening there, so the endpoint is ``down`` at once."""

KV_EVENTS_PORT_LABEL = "epp/kv-events-port"
"""Endpoint label: the port of the endpoint's KV-events PUB socket, when it is not the configured
``socketPort`` (+ rank), e.g. several engines on one host."""
KV_EVENTS_REPLAY_PORT_LABEL = "epp/kv-events-replay-port"
"""Endpoint label: the port of the endpoint's KV-events replay (ROUTER) socket."""


LORA_GPU = "gpu"
"""``Metrics.loaded_adapters`` level: the adapter holds a GPU slot (servable at once)."""
LORA_CPU = "cpu"
"""``Metrics.loaded_adapters`` level: the adapter is in the host (CPU) cache only."""


@dataclass(slots=True, frozen=True)
class EndpointMetadata:
    """Identity and addressing of one endpoint. ``name`` is unique within ``namespace``.

    ``key`` (``namespace/name``: the identity used by the store, the prefix index and session
    tokens) and ``hostport`` (``ip:port``, IPv6 bracketed, as written into the destination header)
    are computed once at construction: plugins read them per request.
    """

    name: str
    address: str
    port: int
    namespace: str = "default"
    pod_name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    metrics_host: str = ""  # "host:port" to scrape; defaults to address:port
    node_address: str = ""  # the IP of the node hosting the pod ("" outside Kubernetes)
    rank: int = 0  # data-parallel rank: the index of this endpoint's port in the pool's target ports
    key: str = field(init=False, repr=False, compare=False)
    hostport: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.namespace}/{self.name}")
        host = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "hostport", f"{host}:{self.port}")

    @property
    def metrics_hostport(self) -> str:
        return self.metrics_host or self.hostport


class MetricsState(StrEnum):
    """Freshness of an endpoint's metrics; only ``FRESH`` metrics are known to the scheduler."""

    NEVER = "never"  # no successful scrape yet (a new endpoint, or no data source)
    FRESH = "fresh"  # extracted within the staleness threshold
    STALE = "stale"  # older than the threshold while the last scrape attempt did not fail
    FAILED = "failed"  # older than the threshold (or never scraped) and the last attempt failed
    DOWN = "down"  # the last attempt found no server (connection refused or reset): whatever its age


@dataclass(slots=True, frozen=True)
class Metrics:
    """One scrape of a model server, normalised across engines.

    ``update_time`` is ``time.monotonic()`` of the last successful extraction (0.0 = never).
    ``kv_cache_usage_percent`` is a 0..1 fraction despite its (reference) name. ``served_models``:
    the ``model_name`` label values of the running-requests series (the base models served).
    ``fresh_until`` is the ``time.monotonic()`` until which the values are trusted (0.0 = never);
    after it, or before the first scrape, the metrics are unknown, not idle. ``failure`` is the
    reason of the last scrape attempt when it failed (``""`` after a success).
    ``inflight_at_scrape`` is ``Endpoint.inflight`` when the scrape began: the requests this EPP
    sent since (or saw finish since) are the difference to the current count, which the snapshot
    cannot show yet (flow control's in-flight credit). ``peak_running`` is the most requests any
    scrape has shown running there: a lower bound of the engine's batch size.
    ``loaded_adapters`` (adapter -> ``LORA_GPU`` / ``LORA_CPU``) and ``gpu_loaded_adapters``: the LoRA
    adapters resident in the engine's caches, when it reports them (``lora_residency``).
    """

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage_percent: float = 0.0
    active_models: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    waiting_models: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    max_active_models: int = 0
    cache_block_size: int = 0
    cache_num_blocks: int = 0
    served_models: tuple[str, ...] = ()
    update_time: float = 0.0
    fresh_until: float = 0.0
    failure: str = ""
    inflight_at_scrape: int = 0
    peak_running: int = 0
    loaded_adapters: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    gpu_loaded_adapters: int = 0
    lora_residency: bool = False

    def lora_level(self, adapter: str) -> str:
        """Where ``adapter`` is resident: ``LORA_GPU``, ``LORA_CPU`` or ``""`` (not resident).

        From the residency metrics when the engine reports them (``lora_residency``); otherwise an
        adapter with running requests counts as on the GPU and nothing is known of the host cache.
        """
        if self.lora_residency:
            return self.loaded_adapters.get(adapter, "")
        return LORA_GPU if adapter in self.active_models else ""

    def lora_slots_used(self) -> int:
        """GPU adapter slots taken (without residency metrics: adapters running or waiting)."""
        if self.lora_residency:
            return self.gpu_loaded_adapters
        return len(self.active_models) + len(self.waiting_models)

    def lora_idle_resident(self) -> bool:
        """True when a GPU-resident adapter has no running request (loading another evicts it)."""
        if not self.lora_residency:
            return False
        active = self.active_models
        return any(level == LORA_GPU and name not in active for name, level in self.loaded_adapters.items())

    def known(self, now: float) -> bool:
        """True while the snapshot is fresh (``now`` is ``time.monotonic()``)."""
        return now <= self.fresh_until

    @property
    def down(self) -> bool:
        """True when the last scrape found no server listening (refused or reset connection)."""
        return self.failure == SCRAPE_CONNECT_FAILURE

    def state(self, now: float) -> MetricsState:
        if self.failure == SCRAPE_CONNECT_FAILURE:  # failure evidence beats metrics still fresh
            return MetricsState.DOWN
        if now <= self.fresh_until:
            return MetricsState.FRESH
        if self.failure:
            return MetricsState.FAILED
        return MetricsState.NEVER if self.update_time == 0.0 else MetricsState.STALE


@dataclass(slots=True, eq=False)
class Endpoint:
    """The live endpoint object held by the store and handed to plugins.

    Identity-hashed (``eq=False``) so that plugins can key dicts by endpoint cheaply. ``metadata`` is
    set by discovery; ``metrics`` is replaced as a whole by the scraper (never mutated in place), so a
    cycle reads it without locks. ``inflight`` counts requests this EPP routed here that have not
    finished (released when the ext_proc stream ends). ``attributes`` holds endpoint-level data
    produced by the data layer (not per request). Each assignment of ``metrics`` is noted in the
    metrics journal (``epp.framework.metrics_journal``).
    """

    metadata: EndpointMetadata
    metrics: Metrics = field(default_factory=Metrics)
    inflight: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "metrics":  # after the write: a reader told of it reads the new value
            JOURNAL.note(self)

    @property
    def hostport(self) -> str:
        return self.metadata.hostport

    def __repr__(self) -> str:
        return f"Endpoint({self.metadata.key} {self.metadata.hostport})"
