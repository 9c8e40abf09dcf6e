"""Session affinity shared by ``session-affinity-scorer`` and ``session-affinity-filter``.

Two strategies: ``encoded_endpoint_header`` (stateless: the client echoes a header holding the
base64 of the serving endpoint's ``namespace/name``) and ``session_id`` (a client-chosen session
identifier bound server-side to the endpoint that served it, in a TTL-evicted map). With a
cross-replica syncer the ``session_id`` map is shared: every binding made, moved or refreshed by
one replica is a record the others apply, so a session pinned by one replica is honoured by all.

With ``sessionIdConfig.kvEventsProducerName`` (an epp extension) the ``session_id`` strategy also
reads what the engines report: their KV events label each stored block with the ``session_id`` of
the request behind it (vLLM since 0.30, SGLang 0.5.20), which a ``precise-prefix-cache-producer``
keeps per session. The candidate holding most of the session's blocks is the target when it holds
more of them than the bound endpoint does (a tie keeps the binding); so a session's next turn finds
its engine even where its re-rendered history no longer matches any cached prefix, after its
binding expired, or on a replica that never bound it. The session id is forwarded to the engine in
``engineSessionHeader`` (``x-session-id``, read by vLLM) unless the request carries that header.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from epp.framework import (
    ConfigError,
    CycleState,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    ResponseHeaderProcessor,
    ResponseInfo,
    SchedulingResult,
    Stability,
)
from epp.framework.cross_replica import SharedLog, valid_time
from epp.framework.params import OMIT_UNSET
from epp.framework.wire import SESSION_TOKEN_HEADER
from epp.kvcache.sessions import SessionResidency
from epp.plugins.producers.session_id import request_attribute_key

__all__ = [
    "STRATEGY_ENCODED_ENDPOINT_HEADER",
    "STRATEGY_SESSION_ID",
    "EncodedEndpointHeaderConfig",
    "SessionAffinity",
    "SessionAffinityParams",
    "SessionAffinityPlugin",
    "SessionIdConfig",
    "SessionIdSource",
    "SessionStore",
    "session_token",
]

log = structlog.get_logger("epp.plugins.session_affinity")

STRATEGY_ENCODED_ENDPOINT_HEADER = "encoded_endpoint_header"
STRATEGY_SESSION_ID = "session_id"
DEFAULT_SESSION_ID_HEADER = "x-session-id"
DEFAULT_EVICTION_TTL_SECONDS = 300.0
DEFAULT_EVICTION_SWEEP_SECONDS = 10.0
MAX_SHARED_SESSION_ID = 1024  # characters; a longer session id stays with the replica that saw it
MAX_SHARED_ENDPOINT_KEY = 512
_HEADER, _ATTRIBUTE, _BODY = 0, 1, 2  # kinds of session id source
REFRESH_FRACTION = 0.1  # a binding in use is announced again after this fraction of the TTL


def session_token(endpoint: Endpoint) -> str:
    """The token that routes a session to ``endpoint``: base64 of ``namespace/name``."""
    return base64.b64encode(endpoint.metadata.key.encode()).decode("ascii")


def _normalize_header(name: str, default: str) -> str:
    return name.strip().lower() or default


@dataclass(slots=True, frozen=True)
class EncodedEndpointHeaderConfig:
    header: str = SESSION_TOKEN_HEADER


@dataclass(slots=True, frozen=True)
class SessionIdSource:
    """One place a session identifier is read from: a request ``header``, a request ``attribute``
    (published by ``producer``, empty for a producer-agnostic attribute), or (epp) a top-level
    string field of the JSON body (``bodyField``, e.g. vLLM's ``session_id``)."""

    header: str = field(default="", metadata=OMIT_UNSET)
    attribute: str = field(default="", metadata=OMIT_UNSET)
    producer: str = field(default="", metadata=OMIT_UNSET)
    body_field: str = field(default="", metadata=OMIT_UNSET)

    def validate(self) -> str | None:
        if self.body_field:
            if self.header or self.attribute:
                return "exactly one of header, attribute or bodyField must be set"
            return None
        if bool(self.header) == bool(self.attribute):
            return "exactly one of header or attribute must be set"
        return None


@dataclass(slots=True, frozen=True)
class SessionIdConfig:
    """``sources`` in priority order (default: the header ``x-session-id``); a binding unused for
    ``evictionTtlSeconds`` is dropped by a sweep every ``evictionSweepSeconds`` (0 = the default).
    ``kvEventsProducerName`` (epp): the ``precise-prefix-cache-producer`` whose KV events say which
    endpoints hold the session's blocks; with it the session id goes to the engine in
    ``engineSessionHeader`` (when ``forwardSessionId``)."""

    sources: tuple[SessionIdSource, ...] = ()
    eviction_ttl_seconds: float = DEFAULT_EVICTION_TTL_SECONDS
    eviction_sweep_seconds: float = DEFAULT_EVICTION_SWEEP_SECONDS
    kv_events_producer_name: str = field(default="", metadata=OMIT_UNSET)
    forward_session_id: bool = field(default=True, metadata=OMIT_UNSET)
    engine_session_header: str = field(default=DEFAULT_SESSION_ID_HEADER, metadata=OMIT_UNSET)

    def __post_init__(self) -> None:
        if not self.sources:
            object.__setattr__(self, "sources", (SessionIdSource(header=DEFAULT_SESSION_ID_HEADER),))
        if self.eviction_ttl_seconds == 0:
            object.__setattr__(self, "eviction_ttl_seconds", DEFAULT_EVICTION_TTL_SECONDS)
        if self.eviction_sweep_seconds == 0:
            object.__setattr__(self, "eviction_sweep_seconds", DEFAULT_EVICTION_SWEEP_SECONDS)

    def validate(self) -> str | None:
        if not self.eviction_ttl_seconds > 0:
            return f"evictionTtlSeconds: must be > 0, got {self.eviction_ttl_seconds}"
        if not self.eviction_sweep_seconds > 0:
            return f"evictionSweepSeconds: must be > 0, got {self.eviction_sweep_seconds}"
        if self.forward_session_id and not self.engine_session_header.strip():
            return "engineSessionHeader: must not be empty when forwardSessionId is true"
        return None


@dataclass(slots=True, frozen=True)
class SessionAffinityParams:
    strategy: str = STRATEGY_ENCODED_ENDPOINT_HEADER
    encoded_endpoint_header_config: EncodedEndpointHeaderConfig = field(
        default_factory=EncodedEndpointHeaderConfig
    )
    session_id_config: SessionIdConfig = field(default_factory=SessionIdConfig)
    profile_name: str = ""

    def validate(self) -> str | None:
        if self.strategy not in (STRATEGY_ENCODED_ENDPOINT_HEADER, STRATEGY_SESSION_ID):
            return (
                f'strategy: must be "{STRATEGY_ENCODED_ENDPOINT_HEADER}" or "{STRATEGY_SESSION_ID}", '
                f'got "{self.strategy}"'
            )
        return None


@dataclass(slots=True)
class _Binding:
    key: str  # the endpoint's namespace/name
    last_seen: float
    stamp: float = 0.0  # wall-clock time the binding was made or moved: the newest wins (sharing)
    announced: float = 0.0  # when a record about it was last sent or received (sharing)


def _valid_binding(v: Any) -> bool:
    """``[session id, endpoint key, stamp, last used]``: bounded non-empty strings, wall times."""
    if not (isinstance(v, list) and len(v) == 4):
        return False
    session_id, key, stamp, used = v
    return (
        isinstance(session_id, str)
        and 0 < len(session_id) <= MAX_SHARED_SESSION_ID
        and isinstance(key, str)
        and 0 < len(key) <= MAX_SHARED_ENDPOINT_KEY
        and valid_time(stamp)
        and valid_time(used)
    )


class SessionStore:
    """Session id -> endpoint key, least recently used first.

    Bounded by time: a sweep (at most every ``sweep`` seconds, run by ``commit``) drops the bindings
    unused for longer than ``ttl``; because the map is in last-use order a sweep stops at the first
    live binding, so it costs O(expired). ``forget_endpoint`` drops every binding of an endpoint.

    Shared (``start_recording``, a cross-replica syncer): a binding made or moved here, or in use
    here and not announced for a tenth of the TTL, becomes a record ``[session id, endpoint key,
    stamp, last used]``; ``apply_records`` takes the other replicas' records. Two replicas that
    bind one session differently within a sync interval converge on the binding with the newer
    stamp (then the larger endpoint key), on every replica alike; a move always stamps later than
    the binding it replaces. A record's last use sets the binding's age, so a peer's binding
    expires ``ttl`` after its last announced use, and a replica that starts and reads the kept
    records takes only the live ones. Without sharing nothing of this runs.
    """

    def __init__(
        self,
        ttl: float,
        sweep: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.ttl = ttl
        self.sweep = sweep
        self._clock = clock
        self._wall = wall
        self._bindings: OrderedDict[str, _Binding] = OrderedDict()
        self._by_endpoint: dict[str, set[str]] = {}
        self._next_sweep = clock() + sweep
        self._outbox: list[list[Any]] | None = None  # records for the other replicas (sharing)
        self._refresh = ttl * REFRESH_FRACTION

    def __len__(self) -> int:
        return len(self._bindings)

    def get(self, session_id: str) -> str | None:
        binding = self._bindings.get(session_id)
        return binding.key if binding is not None else None

    def commit(self, session_id: str, key: str, bound_absent: bool) -> None:
        """Record that ``session_id`` was routed to ``key``.

        An unbound session is bound; a binding to ``key`` is refreshed; a binding to another endpoint
        moves only when ``bound_absent`` (its endpoint was not a candidate for this request).
        """
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)
        bindings = self._bindings
        binding = bindings.get(session_id)
        outbox = self._outbox
        if binding is None:
            binding = bindings[session_id] = _Binding(key, now)
            self._by_endpoint.setdefault(key, set()).add(session_id)
            if outbox is not None:
                binding.stamp = self._wall()
                self._announce(session_id, binding, now, outbox)
            return
        if binding.key != key:
            if not bound_absent:
                return
            self._unindex(binding.key, session_id)
            binding.key = key
            self._by_endpoint.setdefault(key, set()).add(session_id)
            binding.last_seen = now
            bindings.move_to_end(session_id)
            if outbox is not None:
                binding.stamp = max(self._wall(), binding.stamp + 0.001)
                self._announce(session_id, binding, now, outbox)
            return
        binding.last_seen = now
        bindings.move_to_end(session_id)
        if outbox is not None and now - binding.announced >= self._refresh:
            self._announce(session_id, binding, now, outbox)

    def forget_endpoint(self, key: str) -> None:
        for session_id in self._by_endpoint.pop(key, ()):
            self._bindings.pop(session_id, None)

    # --- shared with the other replicas (a cross-replica syncer) --------------------------------

    def start_recording(self) -> None:
        if self._outbox is None:
            self._outbox = []

    def take_records(self) -> list[list[Any]]:
        outbox = self._outbox
        if not outbox:
            return []
        self._outbox = []
        return outbox

    def _announce(self, session_id: str, binding: _Binding, now: float, outbox: list[list[Any]]) -> None:
        binding.announced = now
        if len(session_id) <= MAX_SHARED_SESSION_ID:
            outbox.append([session_id, binding.key, binding.stamp, self._wall()])

    def apply_records(self, records: list[Any]) -> None:
        """The other replicas' ``[session id, endpoint key, stamp, last used]``, oldest first."""
        now, wall = self._clock(), self._wall()
        if now >= self._next_sweep:
            self._sweep(now)
        bindings, ttl = self._bindings, self.ttl
        for session_id, key, stamp, used in records:
            age = wall - used
            if age >= ttl:
                continue  # expired already (a starting replica reading old records)
            seen = now - age if age > 0 else now
            binding = bindings.get(session_id)
            if binding is None:
                bindings[session_id] = _Binding(key, seen, stamp, now)
                self._by_endpoint.setdefault(key, set()).add(session_id)
                continue
            if binding.key != key:
                if (stamp, key) <= (binding.stamp, binding.key):
                    continue  # ours is newer: the peer takes it from our record
                self._unindex(binding.key, session_id)
                binding.key = key
                self._by_endpoint.setdefault(key, set()).add(session_id)
            elif stamp < binding.stamp:
                stamp = binding.stamp
            binding.stamp = stamp
            binding.announced = now
            if seen > binding.last_seen:
                binding.last_seen = seen
                bindings.move_to_end(session_id)

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + self.sweep
        bindings, deadline = self._bindings, now - self.ttl
        while bindings:
            session_id, binding = next(iter(bindings.items()))
            if binding.last_seen >= deadline:
                break
            del bindings[session_id]
            self._unindex(binding.key, session_id)

    def _unindex(self, key: str, session_id: str) -> None:
        ids = self._by_endpoint.get(key)
        if ids is not None:
            ids.discard(session_id)
            if not ids:
                del self._by_endpoint[key]


class SessionAffinity:
    """One plugin instance's session affinity: ``target`` (the session's endpoint among the
    candidates, or None), ``pre_request`` (commits bindings), ``response_header`` (the token)."""

    def __init__(self, plugin_key: str, params: SessionAffinityParams, handle: Handle | None = None) -> None:
        self.strategy = params.strategy
        self.profile_name = params.profile_name
        self._state_key = plugin_key  # cycle / request state of this instance
        self.header = _normalize_header(params.encoded_endpoint_header_config.header, SESSION_TOKEN_HEADER)
        cfg = params.session_id_config
        self._sources: tuple[tuple[int, str], ...] = tuple(
            (_HEADER, _normalize_header(s.header, DEFAULT_SESSION_ID_HEADER))
            if s.header
            else (_BODY, s.body_field)
            if s.body_field
            else (_ATTRIBUTE, request_attribute_key(s.attribute, s.producer))
            for s in cfg.sources
        )
        self.store: SessionStore | None = None
        if self.strategy == STRATEGY_SESSION_ID:
            self.store = SessionStore(cfg.eviction_ttl_seconds, cfg.eviction_sweep_seconds)
        self.residency: SessionResidency | None = None
        self._forward = ""  # the header the session id is forwarded in ("": not forwarded)
        if cfg.kv_events_producer_name:
            if self.strategy != STRATEGY_SESSION_ID:
                log.warning(
                    "sessionIdConfig.kvEventsProducerName needs strategy session_id: ignored",
                    plugin=plugin_key,
                )
            else:
                self.residency = _residency(handle, cfg.kv_events_producer_name)
                if cfg.forward_session_id:
                    self._forward = cfg.engine_session_header.strip().lower()
        if self.strategy == STRATEGY_ENCODED_ENDPOINT_HEADER and cfg != SessionIdConfig():
            log.warning(
                "sessionIdConfig is not used with strategy encoded_endpoint_header", plugin=plugin_key
            )
        elif self.strategy == STRATEGY_SESSION_ID and params.encoded_endpoint_header_config != (
            EncodedEndpointHeaderConfig()
        ):
            log.warning("encodedEndpointHeaderConfig is not used with strategy session_id", plugin=plugin_key)

    # --- scheduling ----------------------------------------------------------------------------

    def target(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Endpoint | None:
        if not endpoints:
            return None
        store = self.store
        if store is None:
            wanted = self._decode(request.headers.get(self.header, ""))
            if not wanted:
                return None
            return next((e for e in endpoints if e.metadata.key == wanted), None)
        session_id = self.session_id(cycle, request)
        if not session_id:
            return None
        bound = store.get(session_id)
        found = None
        if bound is not None:
            found = next((e for e in endpoints if e.metadata.key == bound), None)
            cycle[self._state_key] = found is not None  # bound endpoint present: read by pre_request
        if self.residency is not None:
            holder = self._holder(session_id, endpoints, found)
            if holder is not None:
                if bound is not None:
                    cycle[self._state_key] = False  # the binding follows the session's blocks
                return holder
        return found

    def _holder(self, session_id: str, endpoints: list[Endpoint], bound: Endpoint | None) -> Endpoint | None:
        """The candidate holding most of the session's blocks, when it holds more than the bound
        candidate (None: no candidate holds any, or the bound one holds as many)."""
        assert self.residency is not None
        held = self.residency.holders(session_id)
        if not held:
            return None
        best, most = None, 0
        for e in endpoints:
            n = held.get(e.metadata.key, 0)
            if n > most:
                best, most = e, n
        if best is None or (bound is not None and held.get(bound.metadata.key, 0) >= most):
            return None
        return best

    def session_id(self, cycle: CycleState, request: LLMRequest) -> str:
        """The identifier from the first source that has a non-empty one, ``""`` for none."""
        headers = request.headers
        for kind, key in self._sources:
            if kind == _HEADER:
                value = headers.get(key)
            elif kind == _ATTRIBUTE:
                value = request.state.get(key)
            else:
                value = request.body.payload.get(key)
            if isinstance(value, str):
                value = value.strip()
                if value:
                    return value
        return ""

    @staticmethod
    def _decode(token: str) -> str:
        if not token:
            return ""
        try:
            return base64.b64decode(token, validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError) as e:
            log.debug("cannot decode session token", error=str(e))
            return ""

    # --- request control -----------------------------------------------------------------------

    def picked(self, result: SchedulingResult) -> Endpoint | None:
        """The first endpoint of this instance's profile (``profileName``, default the primary)."""
        run = result.profile_results.get(self.profile_name or result.primary_profile_name)
        return run.target_endpoints[0] if run is not None and run.target_endpoints else None

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        store = self.store
        if store is None:
            if self.profile_name:  # remembered for the response header
                request.state[self._state_key] = self.picked(result)
            return
        session_id = self.session_id(cycle, request)
        if not session_id:
            return
        if self._forward and not request.headers.get(self._forward):
            request.headers[self._forward] = session_id  # the engine labels the blocks it stores
        endpoint = self.picked(result)
        if endpoint is None:
            return
        store.commit(session_id, endpoint.metadata.key, bound_absent=cycle.get(self._state_key) is False)

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        if self.store is not None:
            return  # session_id: the client owns its identifier
        if self.profile_name:
            endpoint = request.state.get(self._state_key)
        if endpoint is not None:
            response.headers[self.header] = session_token(endpoint)

    def remove_endpoint(self, key: str) -> None:
        if self.store is not None:
            self.store.forget_endpoint(key)

    def shared_log(self, state_key: str) -> list[SharedLog]:
        """The ``session_id`` map as a log every replica applies; nothing for the stateless
        ``encoded_endpoint_header`` strategy (the client carries the endpoint)."""
        store = self.store
        if store is None:
            return []
        store.start_recording()
        return [SharedLog(state_key, store.take_records, store.apply_records, _valid_binding)]


class SessionAffinityPlugin(PreRequest, ResponseHeaderProcessor):
    """What the session-affinity filter and scorer share: parameters, the ``SessionAffinity`` state
    and its hooks (binding after scheduling, the response header, a departed endpoint)."""

    stability = Stability.ALPHA
    Params = SessionAffinityParams
    params: SessionAffinityParams

    def __init__(self, name: str, params: SessionAffinityParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.affinity = SessionAffinity(f"session-affinity:{self.typed_name}", params, handle)

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        self.affinity.pre_request(cycle, request, result)

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        self.affinity.response_header(request, response, endpoint)

    def remove_endpoint(self, key: str) -> None:
        self.affinity.remove_endpoint(key)

    def cross_replica_specs(self) -> list[SharedLog]:
        """With ``strategy: session_id``, the session map shared with the other replicas."""
        return self.affinity.shared_log(f"{self.type_name}/{self.name}")


def _residency(handle: Handle | None, name: str) -> SessionResidency | None:
    """The session residency kept by the plugin ``name``; ConfigError when it
    keeps none. None without a handle (a plugin built alone, in tests)."""
    if handle is None:
        return None
    field_name = "sessionIdConfig.kvEventsProducerName"
    plugin = handle.plugin(name)
    if plugin is None:
        raise ConfigError(field_name, f"plugin '{name}' not found")
    residency = getattr(plugin, "sessions", None)
    if not isinstance(residency, SessionResidency):
        raise ConfigError(
            field_name,
            f"plugin '{name}' ({plugin.type_name}) keeps no session residency: "
            "name a precise-prefix-cache-producer",
        )
    return residency
