"""The director: from a parsed request to a routing decision.

The parser for the request path (the request handler's table), parse, model and rewrite, priority,
request-header processors, fairness id, shedding, candidates, screeners, data producers, admitters,
scheduler, PreRequest plugins; every failure becomes an HTTP status with an OpenAI-style error.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import random
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from epp import metrics
from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.rewrites import RewriteStore
from epp.datalayer.store import EndpointStore
from epp.flowcontrol import FlowController, Permit, Victim
from epp.framework import (
    Admitter,
    CycleState,
    DataProducer,
    Endpoint,
    ErrorCode,
    InferenceError,
    LLMRequest,
    LocalResponse,
    Parser,
    Plugin,
    PreRequest,
    ProfileRunResult,
    RequestDone,
    RequestHeaderProcessor,
    Responder,
    SaturationDetector,
    SchedulingResult,
    Screener,
)
from epp.framework.attributes import AGENT_IDENTITY_KEY
from epp.framework.errors import FiltersDrainedError, no_endpoints, saturated
from epp.framework.request import request_path
from epp.framework.wire import (
    DATA_PARALLEL_HEADER,
    DEFAULT_FAIRNESS_ID,
    DESTINATION_SERVED_HEADER,
    ENCODERS_HEADER,
    ENGINE_TYPE_LABEL,
    FAIRNESS_HEADERS,
    LEGACY_ENGINE_TYPE_LABEL,
    MODEL_REWRITE_HEADERS,
    OBJECTIVE_HEADERS,
    POOL_METADATA_KEY,
    PREFILL_HEADER,
    REQUEST_DROPPED_REASON_HEADER,
    REQUEST_ID_HEADER,
    SLO_TPOT_HEADERS,
    SLO_TTFT_HEADERS,
    SUBSET_KEY,
)
from epp.log_limit import LOGS
from epp.scheduling import Scheduler
from epp.scheduling.data_scope import scope_of
from epp.scheduling.decision import DECISION_KEY
from epp.scheduling.parser_router import ParserRouter
from epp.scheduling.profile import EXPLANATIONS_KEY
from epp.server import _eager
from epp.server.activity import EndpointActivity
from epp.server.body_rewrite import replace_model, set_members
from epp.server.decisions import DecisionLog, Entry
from epp.server.subset import filter_by_subset, subset_entries

log = structlog.get_logger("epp.director")
_INFLIGHT = operator.attrgetter("inflight")
_NO_FALLBACK = sys.maxsize  # the primary's place in the fallback's in-flight counts

PRODUCERS_BUDGET_SECONDS = 0.4
SATURATED = 1.0  # legacy admission: saturation at or above this drops sheddable requests
SHED_MESSAGE = "system saturated, sheddable request dropped"
NO_CANDIDATES_MESSAGE = "failed to find endpoint candidates for serving the request"

# Request headers only the EPP may write. A client-sent copy is consumed here and never forwarded
# (the reference forwards them); one present after PreRequest was set by a plugin.
EPP_OWNED_HEADERS = (
    PREFILL_HEADER,
    ENCODERS_HEADER,
    DATA_PARALLEL_HEADER,
    DESTINATION_SERVED_HEADER,
    SUBSET_KEY,
    *OBJECTIVE_HEADERS,
    *FAIRNESS_HEADERS,
    *MODEL_REWRITE_HEADERS,
    *SLO_TTFT_HEADERS,
    *SLO_TPOT_HEADERS,
    REQUEST_DROPPED_REASON_HEADER,
    POOL_METADATA_KEY,
)


def _first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> str:
    """The first non-empty value among ``names`` (a header's current name, then its old ones)."""
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return ""


def _slo_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float:
    """An SLO header in milliseconds (0: absent); 400 when it is not a non-negative number."""
    raw = _first_header(headers, names)
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value == float("inf"):  # also NaN
        raise InferenceError(
            ErrorCode.BAD_REQUEST,
            f"invalid {names[0]} header: expected a non-negative number of milliseconds, got {raw[:64]!r}",
        )
    return value


def _named_model(raw: bytes) -> str:
    """The ``model`` a rejected JSON body names ("" if none): only on the error path."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return ""
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else ""


def _json_type(value: object) -> str:
    """The JSON type name of a decoded value."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _plugin_failed(cause: str, event: str, plugin: Plugin, error: Exception) -> None:
    """A rate-limited warning that ``plugin`` raised ``error`` (the request goes on without it)."""
    LOGS.log(log.warning, cause, event, plugin=plugin.typed_name, error=str(error))


def _explain(
    request: LLMRequest,
    candidates: list[Endpoint],
    cycle: CycleState,
    primary: ProfileRunResult | None,
    err: Exception | None,
) -> None:
    """The per-request debug line: where the request went (or why not) and each profile's reasons."""
    picked = [e.metadata.name for e in primary.target_endpoints] if primary is not None else []
    log.debug(
        "request.scheduled",
        request_id=request.request_id,
        model=request.target_model,
        candidates=len(candidates),
        picked=picked,
        error=None if err is None else str(err),
        profiles=cycle.get(EXPLANATIONS_KEY, []),
    )


def _rewritten(raw: bytes, target: str) -> bytes:
    """``raw`` with its model set to ``target``; 400 when the body cannot be rewritten."""
    try:
        return replace_model(raw, target)
    except ValueError as e:  # a parser that accepts what is not a UTF-8 JSON object
        raise InferenceError(
            ErrorCode.BAD_REQUEST, f"cannot rewrite the model of the request body: {e}"
        ) from None


def engine_priority(priority: int, endpoint: Endpoint) -> int:
    """The priority as the endpoint's engine reads the body's ``priority``: higher is more urgent
    (SGLang, epp's objectives), except vLLM (lower first, label ``llm-d.ai/engine-type: vllm``)."""
    labels = endpoint.metadata.labels
    engine = labels.get(ENGINE_TYPE_LABEL) or labels.get(LEGACY_ENGINE_TYPE_LABEL)
    return -priority if engine == "vllm" else priority


def _with_priority(raw: bytes, priority: int, model: str | None) -> bytes:
    """``raw`` with its ``priority`` (and, when given, its ``model``) set; 400 when not rewritable."""
    literals = {"priority": str(priority)}
    if model is not None:
        literals["model"] = orjson.dumps(model).decode()
    try:
        return set_members(raw, literals)
    except ValueError as e:
        raise InferenceError(
            ErrorCode.BAD_REQUEST, f"cannot set the priority of the request body: {e}"
        ) from None


@dataclass(slots=True)
class Routing:
    """The outcome of routing one request."""

    destination: str  # "ip:port[,ip:port...]"
    endpoints: list[Endpoint]  # the primary endpoints (in-flight accounting)
    body: bytes  # the body to forward (original bytes unless the model was rewritten)
    body_changed: bool = False
    model_changed: bool = False  # the target model differs from the requested one (body rewritten)
    request: LLMRequest | None = None  # None on the random (no body / skip) path
    result: SchedulingResult | None = None
    cycle: CycleState | None = None
    set_headers: dict[str, str] = field(default_factory=dict)  # headers added or changed by the EPP
    fallback: str = ""  # "ip:port" for the data plane's one retry when the primary is unreachable
    permit: Permit | None = None  # flow control's hold until the request is on its endpoints
    victim: Victim | None = None  # flow control may revoke this in-flight request (eviction)
    decision: Entry | None = None  # why it went there (profiles recording decisions)


@dataclass(slots=True)
class DirectorHooks:
    producers: Sequence[DataProducer] = ()
    admitters: Sequence[Admitter] = ()
    pre_request: Sequence[PreRequest] = ()
    request_done: Sequence[RequestDone] = ()
    request_header: Sequence[RequestHeaderProcessor] = ()
    screeners: Sequence[Screener] = ()
    responders: Sequence[Responder] = ()


class Director:
    def __init__(
        self,
        store: EndpointStore,
        parsers: ParserRouter | Parser,
        scheduler: Scheduler,
        hooks: DirectorHooks | None = None,
        use_subset_hint: bool = True,
        *,
        saturation_detector: SaturationDetector | None = None,
        objectives: ObjectiveStore | None = None,
        rewrites: RewriteStore | None = None,
        rng: random.Random | None = None,
        client_model_rewrite: bool = True,
        flow_control: FlowController | None = None,
        propagate_priority: bool = False,
    ) -> None:
        """``parsers``: the request handler's parser table (one ``Parser`` serves every path).
        ``client_model_rewrite``: honour a client's model-rewrite header (``epp serve
        --allow-model-rewrite-header``); when false the header is ignored (and still not forwarded).
        ``flow_control``: with the ``flowControl`` gate on, requests wait there (by priority and
        fairness) before scheduling, instead of the legacy shedding of sheddable requests."""
        self.store = store
        self.parsers = parsers if isinstance(parsers, ParserRouter) else ParserRouter.only(parsers)
        self.scheduler = scheduler
        self.propagate_priority = propagate_priority  # requestHandler.propagatePriority
        self.hooks = hooks or DirectorHooks()
        self.use_subset_hint = use_subset_hint
        self.saturation_detector = saturation_detector
        self.objectives = objectives
        self.rewrites = rewrites
        self._rng = rng or random.Random()
        self.client_model_rewrite = client_model_rewrite
        self.flow_control = flow_control
        self.explain = False  # --log-level=debug: one line per request saying why it went where
        self.decisions: DecisionLog | None = None  # explained decisions (profiles with ``decide``)
        self.activity = EndpointActivity()  # requests and errors per endpoint, last minute
        self.pool_label = ""  # the request metrics' inference_pool label (set with its pool's runtime)

    # --- candidates ------------------------------------------------------------------------

    def candidates(self, metadata: dict[str, dict[str, Any]]) -> list[Endpoint]:
        endpoints = self.store.endpoints()
        if self.use_subset_hint and metadata:
            entries = subset_entries(metadata)
            if entries is not None:
                return filter_by_subset(endpoints, entries)
        return list(endpoints)

    # --- requests without a body, parser skips ---------------------------------------------

    def respond(self, headers: Mapping[str, str]) -> LocalResponse | None:
        """A responder's own answer to a bodyless request, or None (route it). Only called when
        responders are configured."""
        method = headers.get(":method", "GET")
        path = request_path(headers)
        endpoints = self.store.endpoints()
        for responder in self.hooks.responders:
            answer = responder.respond(method, path, endpoints)
            if answer is not None:
                return answer
        return None

    def route_random(self, metadata: dict[str, dict[str, Any]], body: bytes = b"") -> Routing:
        """A uniformly random candidate; the subset hint applies here too."""
        candidates = self.candidates(metadata)
        if not candidates:
            if not self.store.endpoints():
                raise no_endpoints("no pods available in datastore")
            raise no_endpoints(NO_CANDIDATES_MESSAGE)
        for screener in self.hooks.screeners:
            if screener.bodyless:  # e.g. dead engines are out for a GET too (never empties the list)
                candidates = screener.screen_bodyless(candidates) or candidates
        endpoint = self._rng.choice(candidates)
        return Routing(
            destination=endpoint.hostport,
            endpoints=[endpoint],
            body=body,
            fallback=self._fallback(candidates, [endpoint]),
        )

    # --- the scheduled path ----------------------------------------------------------------

    async def route(
        self,
        headers: dict[str, str],
        raw: bytes,
        metadata: dict[str, dict[str, Any]],
        on_request: Callable[[LLMRequest], None] | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> Routing:
        """``on_request`` sees the request once it is built (the caller's metric labels), even if
        routing then fails; ``on_queued`` is called when flow control makes the request wait."""
        path = request_path(headers)
        parser = self.parsers.resolve(path)
        if parser is None:
            raise InferenceError(
                ErrorCode.BAD_REQUEST, f"no parser registered matching path suffix for: {path}"
            )
        try:
            body = parser.parse_request(raw, headers)
        except InferenceError as e:
            e.model = _named_model(raw)
            raise
        if body is None:
            return self.route_random(metadata, raw)

        incoming = body.payload.get("model")
        if not isinstance(incoming, str):
            if incoming is not None:
                raise InferenceError(
                    ErrorCode.BAD_REQUEST,
                    f"invalid model in request body: expected a string, got {_json_type(incoming)}",
                )
            incoming = ""
        target = incoming
        if body.rewritable:  # a JSON body: it must name a model, which may be rewritten
            if not incoming:
                raise InferenceError(ErrorCode.BAD_REQUEST, "model not found in request body")
            if self.client_model_rewrite:
                target = _first_header(headers, MODEL_REWRITE_HEADERS) or target
            if self.rewrites is not None:  # a rule for the incoming model overrides the header
                choice = self.rewrites.choose(incoming, self._rng)
                if choice is not None:
                    target, rewrite_name = choice
                    metrics.MODEL_REWRITE_DECISIONS.labels(rewrite_name, incoming, target).inc()
        objective = _first_header(headers, OBJECTIVE_HEADERS)
        objectives = self.objectives
        priority = objectives.priority(objective) if objectives is not None and objective else 0

        fairness_id = _first_header(headers, FAIRNESS_HEADERS)
        request = LLMRequest(
            request_id=headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4()),
            body=body,
            headers=headers,
            incoming_model=incoming,
            target_model=target,
            priority=priority,
            objective=objective,
            fairness_id=fairness_id or DEFAULT_FAIRNESS_ID,
            request_size_bytes=len(raw),
            slo_ttft_ms=_slo_ms(headers, SLO_TTFT_HEADERS),
            slo_tpot_ms=_slo_ms(headers, SLO_TPOT_HEADERS),
        )
        if on_request is not None:
            on_request(request)
        for key in EPP_OWNED_HEADERS:  # consumed above; plugins may set them again
            headers.pop(key, None)
        hooks = self.hooks
        if hooks.request_header:
            self._request_header(request)
            if not fairness_id:  # an explicit fairness header wins over the agent identity
                agent = request.state.get(AGENT_IDENTITY_KEY)
                if isinstance(agent, str) and agent:
                    request.fairness_id = agent

        fc = self.flow_control
        if fc is None:
            candidates = self.candidates(metadata)
            if priority < 0 and self._saturated(candidates):
                # The reference's legacy admission sets no drop reason (only its flow control does).
                raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, SHED_MESSAGE)
            return await self._schedule(request, raw, candidates, incoming, target)

        def queued() -> None:  # a waiting request holds no parse buffers
            request.body.settle()
            if on_queued is not None:
                on_queued()

        permit = await fc.admit(request, time.monotonic(), queued)
        try:
            routing = await self._schedule(request, raw, self.candidates(metadata), incoming, target)
        except BaseException:
            permit.done()
            raise
        routing.permit = permit
        return routing

    async def _schedule(
        self, request: LLMRequest, raw: bytes, candidates: list[Endpoint], incoming: str, target: str
    ) -> Routing:
        """Candidates to routing: screeners, producers, admitters, the scheduler, PreRequest."""
        hooks = self.hooks
        if not candidates:
            raise no_endpoints(NO_CANDIDATES_MESSAGE)

        if hooks.screeners:
            candidates = self._screen(request, candidates)
            if not candidates:
                raise InferenceError(
                    ErrorCode.SERVICE_UNAVAILABLE, "screeners eliminated all endpoint candidates"
                )

        cycle = CycleState()
        if hooks.producers:
            await self._produce(cycle, request, candidates)
        for admitter in hooks.admitters:
            denial = admitter.admit(cycle, request, candidates)
            if denial is not None:
                raise denial

        t0 = time.perf_counter()
        result, err = self.scheduler.schedule(cycle, request, candidates)
        metrics.SCHEDULER_E2E.observe(time.perf_counter() - t0)
        primary = result.primary if result is not None and err is None else None
        if self.explain:
            _explain(request, candidates, cycle, primary, err)
        if primary is None or not primary.target_endpoints:
            metrics.SCHEDULER_ATTEMPTS.labels("failure", target, "", "", "").inc()
            if isinstance(err, InferenceError):  # a handler that blames the request (e.g. its header)
                raise err
            reason = err if err is not None else "scheduler returned no result for the primary profile"
            drained = err if isinstance(err, FiltersDrainedError) else getattr(err, "__cause__", None)
            if isinstance(drained, FiltersDrainedError):  # candidates exist: the pool is busy, not empty
                raise saturated(str(drained))
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, f"failed to find target endpoint: {reason}")
        assert result is not None
        chosen = primary.target_endpoints
        first = chosen[0].metadata
        pod = first.pod_name or first.name
        metrics.SCHEDULER_ATTEMPTS.labels("success", target, pod, first.namespace, str(first.port)).inc()

        for plugin in hooks.pre_request:
            t0 = time.perf_counter()
            try:
                plugin.pre_request(cycle, request, result)
            except Exception as exc:  # the request is routed anyway; request_done still runs later
                _plugin_failed("pre_request_failed", "pre-request hook failed", plugin, exc)
            metrics.observe_plugin("PreRequest", plugin, time.perf_counter() - t0)

        request.body.settle()  # a lazily parsed body lets its parse buffers go
        entry: Entry | None = None
        decisions = self.decisions
        if decisions is not None:
            decided = cycle.get(DECISION_KEY)
            if decided:
                entry = decisions.record(request.request_id, target, decided)
        model_changed = changed = target != incoming
        if self.propagate_priority and request.body.rewritable:
            prio = engine_priority(request.priority, chosen[0])
            out = _with_priority(raw, prio, target if changed else None)
            changed = True
        else:
            out = _rewritten(raw, target) if changed else raw
        return Routing(
            destination=",".join(e.hostport for e in chosen),
            endpoints=list(chosen),
            fallback=self._fallback(candidates, chosen),
            body=out,
            body_changed=changed,
            model_changed=model_changed,
            request=request,
            result=result,
            cycle=cycle,
            decision=entry,
        )

    def _fallback(self, candidates: Sequence[Endpoint], chosen: Sequence[Endpoint]) -> str:
        """The endpoint for the data plane's one retry when the chosen one cannot be reached.

        A second endpoint of the picker when it returned several (the scheduler's own next
        choice), else the screened candidate with the fewest requests in flight from this EPP
        (random among equals): one pass, no second scheduling run for a retry that is rare.
        ``""`` when there is no other candidate.
        """
        if len(chosen) > 1:
            return chosen[1].hostport
        primary = chosen[0]
        counts = list(map(_INFLIGHT, candidates))  # C-level passes: a thousand candidates cost little
        start = 0
        with contextlib.suppress(ValueError):
            while True:  # the primary (possibly listed twice) is no fallback
                start = candidates.index(primary, start)
                counts[start] = _NO_FALLBACK
                start += 1
        lowest = min(counts, default=_NO_FALLBACK)
        if lowest == _NO_FALLBACK:
            return ""
        ties = counts.count(lowest)
        at = -1
        for _ in range(self._rng.randrange(ties) + 1 if ties > 1 else 1):  # random among equals
            at = counts.index(lowest, at + 1)
        return candidates[at].hostport

    def _request_header(self, request: LLMRequest) -> None:
        """Run the request-header processors in order; the first error rejects the request."""
        for plugin in self.hooks.request_header:
            t0 = time.perf_counter()
            try:
                plugin.request_header(request)
            except InferenceError:
                raise
            except Exception as exc:
                raise InferenceError(
                    ErrorCode.INTERNAL, f"request header processor {plugin.typed_name} failed: {exc}"
                ) from exc
            metrics.observe_plugin("RequestHeader", plugin, time.perf_counter() - t0)

    def _screen(self, request: LLMRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates every screener kept (each sees the full list), in candidate order.

        A screener that raises keeps nothing: screeners guard compatibility (e.g. rollout
        revisions), so failing closed is safer than routing past one.
        """
        kept = candidates
        for plugin in self.hooks.screeners:
            t0 = time.perf_counter()
            try:
                screened = plugin.screen(request, list(candidates))
                if len(screened) == len(candidates):  # a subset as long as the input is all of it
                    metrics.observe_plugin("Screener", plugin, time.perf_counter() - t0)
                    continue
                allowed = {id(e) for e in screened}
            except Exception as exc:
                _plugin_failed("screener_failed", "screener failed", plugin, exc)
                allowed = set()
            metrics.observe_plugin("Screener", plugin, time.perf_counter() - t0)
            kept = [e for e in kept if id(e) in allowed]
        return kept

    def _saturated(self, candidates: list[Endpoint]) -> bool:
        """Legacy admission, asked only for sheddable requests.

        A detector that raises admits the request (logged): shedding is an optimisation, and a
        broken detector must not turn into dropped traffic.
        """
        detector = self.saturation_detector
        if detector is None:
            return False
        try:
            return detector.saturation(candidates) >= SATURATED
        except Exception as e:
            _plugin_failed("saturation_failed", "saturation detector failed", detector, e)
            return False

    async def _produce(self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint]) -> None:
        """Run the producers in order within one shared budget; failures are logged, never fatal.

        Each producer starts eagerly (``_eager.start``); only one that suspends runs under a timer,
        so producers that never suspend, the common case, cost plain calls.
        """
        producers = self.hooks.producers
        budget = max(PRODUCERS_BUDGET_SECONDS, max((p.produce_timeout for p in producers), default=0.0))
        t_start = time.perf_counter()
        for producer in producers:
            t0 = time.perf_counter()
            cycle.scope = scope_of("DataProducer", producer)
            try:
                rest = _eager.start(producer.produce(cycle, request, candidates))
                if rest is not None:
                    deadline = asyncio.get_running_loop().time() + budget - (time.perf_counter() - t_start)
                    try:
                        async with asyncio.timeout_at(deadline) as timer:
                            await rest
                    except TimeoutError:
                        if not timer.expired():
                            raise  # the producer's own timeout: a failure of that producer
                        LOGS.log(
                            log.warning,
                            "producers_budget",
                            "data producers exceeded their budget",
                            budget_s=budget,
                        )
                        return
            except Exception as e:  # a producer failure never fails the request
                _plugin_failed("producer_failed", "data producer failed", producer, e)
            finally:
                cycle.scope = None
            metrics.observe_plugin("DataProducer", producer, time.perf_counter() - t0)

    # --- end of request ----------------------------------------------------------------------

    def track_in_flight(self, routing: Routing, revoke: Callable[[], None] | None = None) -> None:
        """The reply was sent: count the request as in flight on its endpoints. ``revoke`` ends the
        request's stream with 429 (flow control's eviction of in-flight sheddable requests)."""
        activity = self.activity
        for e in routing.endpoints:
            e.inflight += 1
            activity.request(e.hostport)
        if routing.permit is not None:  # flow control's pending count moves to the endpoints'
            routing.permit.release()
            request = routing.request
            if revoke is not None and request is not None and self.flow_control is not None:
                routing.victim = self.flow_control.track(request.priority, revoke)

    def release_in_flight(self, routing: Routing) -> None:
        """The ext_proc stream ended (however): release in-flight state and run done hooks."""
        for e in routing.endpoints:
            e.inflight -= 1
        fc = self.flow_control
        if fc is not None:
            if routing.victim is not None:
                fc.untrack(routing.victim)
            if routing.permit is not None:
                routing.permit.done()  # also kicks the dispatch loop
            fc.kick()
        if routing.request is not None and routing.result is not None:
            for plugin in self.hooks.request_done:
                try:
                    plugin.request_done(routing.request, routing.result)
                except Exception as exc:
                    _plugin_failed("request_done_failed", "request-done hook failed", plugin, exc)
