"""Plugin contracts: the only things a plugin may depend on (with the data types of this package).

Scheduling-path methods are synchronous: a cycle runs without awaiting. Data producers and endpoint
discovery are asynchronous. Nothing here imports the server.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

from epp.framework.endpoint import Endpoint, EndpointMetadata, Metrics
from epp.framework.errors import InferenceError
from epp.framework.flow import BandView, FlowView, QueueItem
from epp.framework.request import LLMRequest, RequestBody
from epp.framework.results import (
    CycleState,
    ProfileRunResult,
    ResponseInfo,
    SchedulingOutcome,
    SchedulingResult,
    ScoredEndpoint,
)
from epp.framework.score_column import ScoreColumn

_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclass(slots=True, frozen=True)
class NoParams:
    """Parameters of a plugin that takes none."""


class Stability(StrEnum):
    """How settled a plugin type is: ``alpha`` types load only with ``--allow-experimental-plugins``."""

    ALPHA = "alpha"
    BETA = "beta"


class Handle(Protocol):
    """What a plugin factory may use: the other declared plugins, and the current endpoints.

    ``plugin(name)`` returns any plugin declared under ``plugins:``, creating it first when it was
    declared later in the list (a reference cycle is a configuration error); None for other names.
    """

    def plugin(self, name: str) -> Plugin | None: ...

    def endpoints(self) -> Sequence[Endpoint]: ...


class Plugin:
    """Base class of every plugin instance.

    A plugin subclasses one or more of the kinds below and is used in every slot it fits (a scorer
    that is also a filter runs in both). ``type_name`` is its registered type string; ``Params`` a
    dataclass of typed parameters (see ``epp.framework.params``).
    """

    type_name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    stability: ClassVar[Stability] = Stability.BETA
    # data keys (epp.framework.attributes) this plugin reads from / writes to the CycleState
    consumes: ClassVar[frozenset[str]] = frozenset()
    produces: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str, params: Any, handle: Handle | None = None) -> None:
        self.name = name
        self.params = params

    @property
    def typed_name(self) -> str:
        return f"{self.name}/{self.type_name}"

    def config_warnings(self, plugins: Mapping[str, Plugin]) -> Sequence[tuple[str, str]]:
        """What in this plugin's configuration loads but probably does not do what the user meant
        (a file that does not exist, a plugin that gets nothing to work on): ``(field, reason)``
        pairs, ``field`` relative to the plugin's ``parameters`` ("" = the plugin itself).

        Called once when the configuration has loaded, with every plugin by name; ``epp
        check-config`` and ``epp serve`` print the warnings. The default has none.
        """
        return ()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.typed_name}>"


class Profile(Protocol):
    """A scheduling profile as profile handlers see it (implemented by ``SchedulerProfile``)."""

    name: str

    def run(self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint]) -> ProfileRunResult: ...


# --- scheduling -------------------------------------------------------------------------------


class Filter(Plugin, abc.ABC):
    """Narrows the candidate list. Returning an empty list fails the profile."""

    @abc.abstractmethod
    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]: ...


class Scorer(Plugin, abc.ABC):
    """Scores each endpoint; the framework clamps scores to [0, 1] and multiplies by the weight.

    ``score`` returns one float per input endpoint, in the same order (a list is cheaper than a map).
    ``category`` (Affinity / Distribution / Balance) is informational.
    """

    category: ClassVar[str] = "Distribution"
    # Bulk path (optional, see docs/plugins.md "Scoring many endpoints"): True when ``score``
    # depends only on the candidates' ``Metrics`` objects, in order, and on each being fresh now
    # (``fresh_until``): the profile reuses its last scores while the candidates, their
    # ``Metrics`` objects and their freshness are unchanged.
    metrics_only: ClassVar[bool] = False

    @abc.abstractmethod
    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]: ...

    def score_grouped(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> tuple[Iterable[Hashable], Callable[[Any], float]] | None:
        """Bulk path (optional), for scorers whose scores take few distinct values: a label per
        endpoint, in order (any iterable, read once), and the score of a label (called once per
        distinct label); ``score`` would give ``score_of(labels[i])`` to ``endpoints[i]``.
        None: call ``score``."""
        return None

    def score_bulk(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> Sequence[float] | None:
        """Bulk path (optional, any scorer): exactly what ``score`` would return, computed from
        state the scorer keeps across requests (columns in step with the candidates). None: call
        ``score``."""
        return None

    def score_column(self, endpoints: list[Endpoint]) -> ScoreColumn | None:
        """Bulk path (optional, ``metrics_only`` scorers): the scores of ``endpoints``, whose
        metrics are all fresh, as a ``ScoreColumn`` the profile patches where metrics change.
        None: call ``score``."""
        return None


class Picker(Plugin, abc.ABC):
    """Chooses the target endpoint(s) from the scored list (several = fallbacks, best first)."""

    @abc.abstractmethod
    def pick(
        self, cycle: CycleState, request: LLMRequest, scored: list[ScoredEndpoint]
    ) -> ProfileRunResult: ...

    def pick_totals(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint], totals: list[float]
    ) -> ProfileRunResult | None:
        """Bulk path (optional): what ``pick`` would return for ``ScoredEndpoint(endpoints[i],
        totals[i])``, random draws included, without building those objects. None: call ``pick``."""
        return None


class ProfileHandler(Plugin, abc.ABC):
    """Chooses which profiles run, and decides from their results whether the request is served.

    ``pick_profiles`` is called repeatedly until it returns no profile; it may write ``None`` into
    ``results`` to record a stage it declined. ``process_results`` alone decides whether a failed
    profile (a ``None`` entry) fails the request: ``SchedulingOutcome.serve(result)`` or
    ``SchedulingOutcome.fail(error)``.
    """

    @abc.abstractmethod
    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: MutableMapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]: ...

    @abc.abstractmethod
    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome: ...

    def validate_profiles(self, profile_names: Sequence[str]) -> str | None:
        """Return a reason when this handler cannot work with these profiles (checked at load)."""
        return None


# --- request control --------------------------------------------------------------------------


class RequestHeaderProcessor(Plugin, abc.ABC):
    """Runs once the request is assembled, before admission, candidates and everything below.

    It may record request attributes in ``request.state`` (e.g. ``AGENT_IDENTITY_KEY``, from which
    the director derives the fairness id when no fairness header was sent) and edit
    ``request.headers``. Raising ``InferenceError`` rejects the request with that error.
    """

    @abc.abstractmethod
    def request_header(self, request: LLMRequest) -> None: ...


class Screener(Plugin, abc.ABC):
    """Narrows the located candidates before data producers, admitters and every profile run.

    Every screener sees the same input list; the director keeps the endpoints all of them
    returned (the intersection, in candidate order). No endpoint left fails the request with 503.
    """

    @abc.abstractmethod
    def screen(self, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]: ...

    bodyless: ClassVar[bool] = False
    """True for screeners that also narrow the random pick of requests without a parsed body (a
    GET, a parser skip), through ``screen_bodyless``."""

    def screen_bodyless(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        return endpoints


@dataclass(slots=True, frozen=True)
class LocalResponse:
    """An answer the EPP gives itself, without routing (``Responder``)."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)


class Responder(Plugin, abc.ABC):
    """Answers a request that has no body (``GET /v1/models``) itself instead of routing it.

    Asked in ``plugins:`` order, only for requests whose headers end the stream; the first answer
    wins, ``None`` declines. Raising ``InferenceError`` answers with that error. ``endpoints`` is
    the whole pool. Must be cheap: it runs on the ext_proc stream's task.
    """

    @abc.abstractmethod
    def respond(self, method: str, path: str, endpoints: Sequence[Endpoint]) -> LocalResponse | None: ...


class DataProducer(Plugin, abc.ABC):
    """Computes per-request data (e.g. prefix matches) before scheduling; errors are only logged.

    Per-endpoint results go into the cycle state as ``cycle[KEY] = {endpoint: value}``. The
    producers share one time budget per request; ``produce_timeout`` (seconds, 0 = none) raises it
    for a producer that waits on purpose (e.g. for a batching window).
    """

    produce_timeout: float = 0.0

    @abc.abstractmethod
    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None: ...


class Admitter(Plugin, abc.ABC):
    """Admits or denies a request before scheduling; return an error to deny."""

    @abc.abstractmethod
    def admit(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> InferenceError | None: ...


class PreRequest(Plugin, abc.ABC):
    """Runs after scheduling, before the reply to Envoy (may edit ``request.headers``)."""

    @abc.abstractmethod
    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None: ...


class ResponseHeaderProcessor(Plugin, abc.ABC):
    """Sees the upstream response headers; may add headers through ``response.headers``."""

    @abc.abstractmethod
    def response_header(
        self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None
    ) -> None: ...


class ResponseBodyProcessor(Plugin, abc.ABC):
    """Sees response body chunks. Declaring one makes the EPP process response bodies."""

    @abc.abstractmethod
    def response_body(
        self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None, chunk: bytes
    ) -> None: ...


class RequestDone(Plugin, abc.ABC):
    """Called exactly once when a scheduled request's ext_proc stream ends (success or not)."""

    @abc.abstractmethod
    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None: ...


@runtime_checkable
class SupportsDisaggregate(Protocol):
    """A decider: should a request also go through a disaggregated stage (remote prefill/encode)?

    Asked by the disaggregation profile handlers after the decode endpoint was picked; it may read
    per-request endpoint data from the cycle state. Must be cheap and must not raise.
    """

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool: ...


class Decider(Plugin, abc.ABC):
    """Base class of decider plugins (``SupportsDisaggregate`` is what handlers check)."""

    @abc.abstractmethod
    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
        """True when the stage this decider guards should run for ``request``."""


# --- admission --------------------------------------------------------------------------------


class SaturationDetector(Plugin, abc.ABC):
    """Reports how saturated a set of endpoints is, for admission (and flow control).

    ``saturation`` returns a non-negative number where ``>= 1.0`` means saturated: the legacy
    admission check drops sheddable requests (priority < 0) when the candidates' saturation reaches
    1.0. It is called per sheddable request, so it must be cheap, and must not raise. Selected by
    ``saturationDetector.pluginRef`` (default ``utilization-detector``).
    """

    @abc.abstractmethod
    def saturation(self, endpoints: Sequence[Endpoint]) -> float: ...

    reclaim_grace: ClassVar[float] = 0.25
    """Seconds after a revoked request's stream ended before flow control's eviction revokes
    another: how long the freed capacity takes to show in this detector's saturation."""

    def dispatch_saturation(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        """Saturation as flow control's dispatch gate sees it: also counting ``pending`` requests
        that were released from the queue but are not on an endpoint yet (still being scheduled).
        The default ignores them; the built-in detectors count them."""
        return self.saturation(endpoints)


class OrderingPolicy(Plugin, abc.ABC):
    """Flow control: orders the requests queued within one flow (``orderingPolicyRef``).

    ``sort_key`` is called once per item when it is queued; the flow dispatches the smallest key
    first (ties: arrival order). Keys of one band's items must be comparable with each other, since
    a band's flows share its ordering policy and fairness policies compare their heads.
    """

    @abc.abstractmethod
    def sort_key(self, item: QueueItem) -> tuple[float, ...]: ...


class FairnessPolicy(Plugin, abc.ABC):
    """Flow control: chooses between the flows of one priority band (``fairnessPolicyRef``).

    One instance serves many bands: per-band state comes from ``new_state`` and is handed back as
    ``band.policy_state``. ``pick`` is called only for a band with at least one non-empty flow and
    returns the flow whose head dispatches next (None: nothing eligible now). ``dispatched`` is told
    about each item that left a band this policy serves. A policy that also needs request completion
    subclasses ``RequestDone`` or ``ResponseBodyProcessor`` as well.
    """

    share_in_flight: ClassVar[bool] = False
    """True: flow control balances the band's *in-flight* requests too: when ``pick`` returns a
    flow holding more than its share of them, a queued flow at or under its share goes instead,
    and with none, the last request's room under the ceiling is kept for the band's other active
    flows. False: ``pick`` alone decides (e.g. strict FCFS across flows)."""

    def new_state(self) -> Any:
        return None

    def flow_caps(self, band: BandView, capacity: float) -> Mapping[str, float] | None:
        """In-flight caps for this dispatch cycle, by fairness id, given ``capacity``: the pool's
        measured concurrency capacity (the requests in flight that saturate it; 0.0 while the pool
        is less than half saturated or none has been measured). Called once per cycle before
        ``pick`` for a band that is not gated. A flow may dispatch only while its in-flight
        requests are under its cap (a flow missing from the map has none); when no queued flow is
        under its cap, the band holds the room it left and the bands below it wait too. None (the
        default): no caps."""
        return None

    @abc.abstractmethod
    def pick(self, band: BandView) -> FlowView | None: ...

    def dispatched(self, band: BandView, item: QueueItem) -> None:
        return None


class UsageLimitPolicy(Plugin, abc.ABC):
    """Flow control: per-band saturation ceilings (``flowControl.usageLimitPolicyPluginRef``).

    Called exactly once per dispatch cycle with the pool saturation and the priorities of the bands
    that have queued requests (highest first); writes the ceiling of ``priorities[i]`` into
    ``ceilings[i]``, which comes pre-filled with 1.0 (no gating). A band is gated while saturation
    is at or above its ceiling, and the cycle stops at the first gated band, so ceilings must not
    increase along ``priorities``. 0.0 gates a band whatever the saturation.
    """

    @abc.abstractmethod
    def compute_limit(self, saturation: float, priorities: Sequence[int], ceilings: list[float]) -> None: ...


# --- request handling -------------------------------------------------------------------------


class Parser(Plugin, abc.ABC):
    """Turns the raw request body into a ``RequestBody``.

    ``claims``: the path suffixes this parser serves (``"chat/completions"``); the request handler
    picks, per request, the parser whose suffix is the longest one matching the path. A parser that
    claims none is the fallback for paths no other parser claims.

    Raise ``InferenceError(BAD_REQUEST, ...)`` on a bad body; return ``None`` to skip scheduling
    (the request then goes to a random endpoint).
    """

    claims: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody | None: ...

    def supported_app_protocols(self) -> tuple[str, ...]:
        """InferencePool ``appProtocol`` values this parser serves; readiness is off for others.

        Empty: no constraint (a parser that does not look at the body)."""
        return ("http", "kubernetes.io/h2c")


# --- data layer -------------------------------------------------------------------------------


class EndpointNotifier(Protocol):
    """Where discovery reports endpoints (implemented by the endpoint store)."""

    def upsert(self, metadata: EndpointMetadata) -> None: ...

    def delete(self, key: str) -> None: ...

    def keys(self) -> frozenset[str]: ...


class EndpointDiscovery(Plugin, abc.ABC):
    """A source of endpoints other than Kubernetes, selected by ``dataLayer.discovery.pluginRef``.

    ``start`` returns once the initial set was loaded (raising on a fatal error) and keeps watching
    in a background task until ``stop``. ``on_problem`` (set by the server before ``start``) is
    called with a description when the source keeps serving endpoints despite a bad update (a
    rejected file, skipped entries) and with ``""`` once the source is clean again.
    """

    on_problem: Callable[[str], None] | None = None

    @abc.abstractmethod
    async def start(self, notifier: EndpointNotifier) -> None: ...

    async def stop(self) -> None:
        return None


@runtime_checkable
class EndpointStateHolder(Protocol):
    """A plugin keeping per-endpoint state (an index, counters): told when an endpoint leaves."""

    def remove_endpoint(self, key: str) -> None: ...


class UpstreamFailure(StrEnum):
    """A request attempt that failed at the engine, as the data plane reports it."""

    CONNECT = "connect"  # no connection to the engine (refused, timed out)
    RESET = "reset"  # the connection was reset or closed before response headers
    SERVER_ERROR = "server_error"  # the engine answered with a 5xx status


@runtime_checkable
class UpstreamFailureListener(Protocol):
    """A plugin told of failed request attempts (passive health): ``hostport`` is the engine's
    ``ip:port``, ``now`` is ``time.monotonic()``. Called on the event loop, off the request path."""

    def upstream_failed(self, hostport: str, failure: UpstreamFailure, now: float) -> None: ...


@runtime_checkable
class ServingHooks(Protocol):
    """A plugin with work of its own while the EPP serves (a background thread, sockets).

    ``epp serve`` awaits ``start_serving`` once the endpoint source has loaded, before ext_proc
    accepts streams, and ``stop_serving`` at shutdown; ``epp check-config`` calls neither, so a
    plugin must not start such work in its constructor.
    """

    async def start_serving(self) -> None: ...

    async def stop_serving(self) -> None: ...


@runtime_checkable
class MetadataExtractor(Protocol):
    """A data-layer plugin deriving endpoint-level data from an endpoint's metadata (labels).

    The server calls ``extract_metadata`` when an endpoint is added and whenever its metadata
    changes; it writes ``endpoint.attributes`` (keys ``"<attribute>/<producer name>"``) and must
    not raise.
    """

    def extract_metadata(self, endpoint: Endpoint) -> None: ...


@runtime_checkable
class ReplicatedState(Protocol):
    """A plugin whose learned state standby replicas mirror (``--ha-enable-leader-election``).

    With leader election every replica calls ``start_recording()`` once; from then on the plugin
    keeps the updates its request hooks make (JSON-serialisable values, e.g. "these block hashes
    now live on endpoint k") until ``take_updates()`` drains them. The leader ships them to the
    standbys, which ``apply_updates`` them, so a new leader starts with the learned state (e.g. the
    prefix index) instead of an empty one. A standby that connects gets ``reset_replica()`` and then
    the leader's ``snapshot_updates()`` before the live updates. Instances are matched by plugin
    name (replicas run the same configuration). Recording must cost nothing until
    ``start_recording``.
    """

    def start_recording(self) -> None: ...

    def take_updates(self) -> list[Any]: ...

    def apply_updates(self, updates: list[Any]) -> None: ...

    def snapshot_updates(self) -> Iterator[list[Any]]:
        """The current state as batches of updates (for a standby that just connected)."""
        ...

    def reset_replica(self) -> None:
        """Forget the state before a snapshot is applied (standby side)."""
        ...


class DataSource(Plugin):
    """A data source configured under ``dataLayer.sources``: polled per endpoint
    (``PollingSource``, e.g. ``metrics-data-source``) or notification-driven (``EndpointSource``,
    ``NotificationSource``).

    ``payload`` names what its extractors receive; an extractor whose ``accepts`` differs is
    rejected at load. ``interval`` (seconds, None = every base tick) is a polled source's own period.
    """

    payload: ClassVar[str] = "prometheus"
    interval: float | None = None


class Extractor(Plugin):
    """Turns a data source's output into endpoint data (e.g. ``core-metrics-extractor``)."""

    accepts: ClassVar[str] = "prometheus"


@dataclass(slots=True, frozen=True)
class ExtractResult:
    """What an extractor made of one body: a new snapshot (None = nothing extracted) and errors."""

    metrics: Metrics | None
    errors: tuple[str, ...] = ()


class PollError(Exception):
    """A failed poll whose ``reason`` is one of the scraper's failure reasons (a bounded label)."""

    def __init__(self, message: str, reason: str = "poll_error") -> None:
        super().__init__(message)
        self.reason = reason


class Poller(Protocol):
    """A per-endpoint connection to a polled source; ``poll`` calls never overlap."""

    async def poll(self) -> bytes: ...

    def close(self) -> None: ...


@runtime_checkable
class PollingSource(Protocol):
    """What the scraper needs of a ``DataSource``: per-endpoint pollers (``metrics-data-source``)."""

    def poller(self, endpoint: Endpoint) -> Poller: ...


@runtime_checkable
class MetricsExtractor(Protocol):
    """What the scraper needs of an ``Extractor``: body -> metrics (``core-metrics-extractor``)."""

    def extract(self, endpoint: Endpoint, body: bytes) -> ExtractResult: ...


@runtime_checkable
class AttributeExtractor(Protocol):
    """An ``Extractor`` that writes ``Endpoint.attributes`` from a polled payload (``dcgm-extractor``).

    Returns the problems found (an empty tuple on success); must not raise for bad input.
    """

    def extract_attributes(self, endpoint: Endpoint, payload: Any) -> tuple[str, ...]: ...


@dataclass(slots=True, frozen=True)
class LoadReport:
    """One pushed load message of one engine rank (SGLang's ``LoadStat``): requests running and
    waiting, KV tokens held and the KV capacity in tokens (0 = unknown)."""

    running: int
    waiting: int
    num_tokens: int
    max_total_tokens: int
    dp_rank: int | None = None


@runtime_checkable
class PushSource(Protocol):
    """A source engines push their load to (``zmq-metrics-data-source``): one stream per endpoint
    at ``push_address``; pushes older than ``fallback_after`` seconds hand the endpoint back to
    the metrics scrape."""

    fallback_after: float

    def push_address(self, endpoint: Endpoint) -> str: ...


@runtime_checkable
class LoadExtractor(Protocol):
    """An ``Extractor`` decoding one pushed message (``zmq-state-extractor``); raises ``ValueError``
    for a malformed one, returns None for a message of another kind (skipped)."""

    def extract_load(self, payload: bytes) -> LoadReport | None: ...


class EventType(StrEnum):
    ADD_OR_UPDATE = "AddOrUpdate"
    DELETE = "Delete"


@dataclass(slots=True, frozen=True)
class EndpointEvent:
    """An endpoint joined (or changed in) the store, or left it."""

    type: EventType
    endpoint: Endpoint


@dataclass(slots=True, frozen=True)
class NotificationEvent:
    """A Kubernetes object of a watched kind was added/updated or deleted (``object`` as JSON)."""

    type: EventType
    object: Mapping[str, Any]


@dataclass(slots=True, frozen=True)
class GroupVersionKind:
    group: str
    version: str
    kind: str

    def __str__(self) -> str:
        gv = f"{self.group}/{self.version}" if self.group else self.version
        return f"{gv}, Kind={self.kind}"


@runtime_checkable
class EndpointSource(Protocol):
    """A source fed endpoint lifecycle events (``endpoint-notification-source``); returns the event
    to hand to its extractors, or None to drop it."""

    def notify_endpoint(self, event: EndpointEvent) -> EndpointEvent | None: ...


@runtime_checkable
class EndpointExtractor(Protocol):
    """An ``Extractor`` fed endpoint lifecycle events; must not raise."""

    def extract_endpoint(self, event: EndpointEvent) -> None: ...


@runtime_checkable
class NotificationSource(Protocol):
    """A source watching one Kubernetes kind (``k8s-notification-source``)."""

    @property
    def gvk(self) -> GroupVersionKind: ...

    def notify(self, event: NotificationEvent) -> NotificationEvent | None: ...


@runtime_checkable
class NotificationExtractor(Protocol):
    """An ``Extractor`` fed the events of the kind ``gvk`` (it must match its source's)."""

    @property
    def gvk(self) -> GroupVersionKind: ...

    def extract_notification(self, event: NotificationEvent) -> None: ...
