"""``predicted-latency-producer``: per-endpoint TTFT/TPOT predictions and SLO headroom, learned in-process.

Produce predicts each candidate's TTFT and TPOT from request and load features with online ridge
regressions (one per endpoint, one for the pool) and writes ``LatencyPredictionInfo``; PreRequest
notes the dispatch time; the response body supplies the observed latencies the models learn from.
No sidecar.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from epp import promlite
from epp.framework import (
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    RequestDone,
    ResponseBodyProcessor,
    ResponseInfo,
    SchedulingResult,
    register,
)
from epp.framework.attributes import (
    INFLIGHT_LOAD_KEY,
    LATENCY_PREDICTION_INFO_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
    InFlightLoad,
    LatencyPredictionInfo,
)
from epp.framework.durations import parse_go_duration
from epp.plugins.producers._latency_model import ErrorWindow, OnlineRidge
from epp.plugins.producers.inflight_load import estimate_input_tokens, uncached_input_tokens
from epp.plugins.scorers._data_keys import check_producers

__all__ = ["PredictedLatencyParams", "PredictedLatencyProducer", "tpot_features", "ttft_features"]

TYPE_NAME = "predicted-latency-producer"
PREFILL_PROFILE = "prefill"
PREFILL_ROLE = "prefill"
DEFAULT_SAMPLING_MEAN = 1000.0
TTFT_DIM = 9
TPOT_DIM = 5
RIDGE = 0.1
ERROR_WINDOW = 200
_CLIENT_OUTPUT_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

log = structlog.get_logger("epp.predicted_latency")

_GENERAL_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45,
    60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6,
    0.8, 1, 1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60, 90, 120, 180, 270, 360,
)  # fmt: skip
_DURATION_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_PLUGIN_LABELS = ("plugin_name", "plugin_type")

PREDICTED_TTFT = promlite.Histogram(
    "llm_d_epp_request_predicted_ttft_seconds",
    "[ALPHA] Inference model Predicted TTFT distribution in seconds.",
    _PLUGIN_LABELS,
    buckets=_GENERAL_BUCKETS,
)
PREDICTED_TPOT = promlite.Histogram(
    "llm_d_epp_request_predicted_tpot_seconds",
    "[ALPHA] Inference model Predicted TPOT distribution in seconds.",
    _PLUGIN_LABELS,
    buckets=_TPOT_BUCKETS,
)
TTFT_PREDICTION_DURATION = promlite.Histogram(
    "llm_d_epp_request_ttft_prediction_duration_seconds",
    "[ALPHA] Duration taken to generate TTFT predictions in seconds.",
    _PLUGIN_LABELS,
    buckets=_DURATION_BUCKETS,
)
TPOT_PREDICTION_DURATION = promlite.Histogram(
    "llm_d_epp_request_tpot_prediction_duration_seconds",
    "[ALPHA] Duration taken to generate TPOT predictions in seconds.",
    _PLUGIN_LABELS,
    buckets=_DURATION_BUCKETS,
)
SLO_VIOLATIONS = promlite.Counter(
    "llm_d_epp_request_slo_violation_total",
    "[ALPHA] Counter of SLO violations for each violation type.",
    (*_PLUGIN_LABELS, "type"),
)
PREDICTOR_MAPE = promlite.Gauge(
    "llm_d_epp_latency_predictor_mape",
    "[ALPHA] Mean absolute percentage error (a ratio) of the in-process latency predictor over its "
    f"last {ERROR_WINDOW} scored predictions, per target (ttft, tpot; ttft is e2e latency outside "
    "streaming mode).",
    ("plugin_name", "target"),
)
PREDICTOR_SAMPLES = promlite.Counter(
    "llm_d_epp_latency_predictor_training_samples_total",
    "[ALPHA] Observed latencies the in-process latency predictor has learned from, per target.",
    ("plugin_name", "target"),
)
promlite.register(
    PREDICTED_TTFT,
    PREDICTED_TPOT,
    TTFT_PREDICTION_DURATION,
    TPOT_PREDICTION_DURATION,
    SLO_VIOLATIONS,
    PREDICTOR_MAPE,
    PREDICTOR_SAMPLES,
    owners=("predicted-latency-producer",),
)


@dataclass(slots=True, frozen=True)
class PredictedLatencyParams:
    sampling_mean: float = DEFAULT_SAMPLING_MEAN  # deprecated, ignored
    max_decode_token_samples_for_prediction: int = 0  # deprecated, ignored
    slo_buffer_factor: float = 1.0
    context_ttl: str | int = field(default="5m", metadata={"key": "contextTTL"})
    streaming_mode: bool = False
    endpoint_role_label: str = ""
    predict_in_produce: bool = True
    prefix_match_info_producer_name: str = ""
    in_flight_load_producer_name: str = ""
    use_encoder_cache_features: bool = False
    encoder_cache_match_info_producer_name: str = ""
    # epp extensions: the in-process predictor
    warmup_samples: int = 20
    forgetting_factor: float = 0.995

    def validate(self) -> str | None:
        if not self.slo_buffer_factor > 0:
            return f"sloBufferFactor: must be > 0, got {self.slo_buffer_factor:g}"
        if self.ttl_seconds() is None:
            return f"contextTTL: must be a positive duration such as '5m', got {self.context_ttl!r}"
        if self.use_encoder_cache_features:
            return (
                "useEncoderCacheFeatures: epp has no multimodal encoder-cache producer to read "
                "encoder sizes from; leave it false"
            )
        if self.warmup_samples < 1:
            return f"warmupSamples: must be >= 1, got {self.warmup_samples}"
        if not 0.0 < self.forgetting_factor <= 1.0:
            return f"forgettingFactor: must be in (0, 1], got {self.forgetting_factor:g}"
        return None

    def ttl_seconds(self) -> float | None:
        """``contextTTL`` in seconds (a Go duration string, or integer nanoseconds); None if invalid."""
        ttl = self.context_ttl
        seconds = ttl / 1e9 if isinstance(ttl, int) else parse_go_duration(ttl)
        return seconds if seconds is not None and seconds > 0 else None


def _client_output_cap(request: LLMRequest) -> int:
    payload = request.body.payload
    for key in _CLIENT_OUTPUT_CAPS:
        v = payload.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return 0


def ttft_features(
    uncached: int, requests: int, inflight_tokens: int, waiting: int, kv: float, output: int
) -> list[float]:
    """``[1, u, r, u·r, waiting, kv, inflight tokens, o, o·r]`` (token counts in thousands)."""
    u = uncached / 1000.0
    o = output / 1000.0
    r = float(requests)
    return [1.0, u, r, u * r, float(waiting), kv, inflight_tokens / 1000.0, o, o * r]


def tpot_features(requests: int, waiting: int, kv: float, n_input: int) -> list[float]:
    """``[1, r, waiting, kv, prompt tokens]`` (tokens in thousands)."""
    return [1.0, float(requests), float(waiting), kv, n_input / 1000.0]


@dataclass(slots=True)
class _Candidate:
    """One candidate's features at Produce, and what was predicted from them (None: no prediction)."""

    ttft_x: list[float]
    tpot_x: list[float]
    ttft: float | None = None
    tpot: float | None = None


@dataclass(slots=True)
class _Pending:
    """A request between Produce and its response end."""

    slo_ttft: float
    slo_tpot: float
    candidates: dict[Endpoint, _Candidate]
    t_dispatch: float = 0.0
    target: Endpoint | None = None
    prefill: Endpoint | None = None
    ttft_ms: float = 0.0
    events: int = 0
    finished: bool = False


class _Running:
    """The TPOT SLOs of the requests running on one endpoint, with their minimum cached."""

    __slots__ = ("_min", "slos")

    def __init__(self) -> None:
        self.slos: dict[str, float] = {}
        self._min: float | None = None

    def add(self, request_id: str, slo: float) -> None:
        self.slos[request_id] = slo
        if self._min is not None and slo < self._min:
            self._min = slo

    def remove(self, request_id: str) -> None:
        slo = self.slos.pop(request_id, None)
        if slo is not None and slo == self._min:
            self._min = None  # recomputed on the next read

    def min_slo(self) -> float:
        """The smallest TPOT SLO (0 when a request without one runs, or none runs)."""
        if self._min is None:
            self._min = min(self.slos.values(), default=0.0)
        return self._min

    def __len__(self) -> int:
        return len(self.slos)


class _Models:
    """The TTFT and TPOT regressions of one endpoint (or of the pool)."""

    __slots__ = ("tpot", "ttft")

    def __init__(self, forgetting: float, warmup: int) -> None:
        self.ttft = OnlineRidge(TTFT_DIM, forgetting=forgetting, ridge=RIDGE, warmup=warmup)
        self.tpot = OnlineRidge(TPOT_DIM, forgetting=forgetting, ridge=RIDGE, warmup=warmup)


@register
class PredictedLatencyProducer(DataProducer, PreRequest, ResponseBodyProcessor, RequestDone):
    """See the module docstring; the features, learning and headroom rules are in docs/plugins.md."""

    type_name = TYPE_NAME
    Params = PredictedLatencyParams
    params: PredictedLatencyParams
    produces = frozenset({LATENCY_PREDICTION_INFO_KEY})
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY, INFLIGHT_LOAD_KEY})

    def __init__(
        self,
        name: str,
        params: PredictedLatencyParams | None = None,
        handle: Handle | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        params = params if params is not None else PredictedLatencyParams()
        super().__init__(name, params, handle)
        check_producers(handle, params)
        ttl = params.ttl_seconds()
        if ttl is None:
            raise ConfigError("contextTTL", f"must be a positive duration, got {params.context_ttl!r}")
        if (
            params.sampling_mean != DEFAULT_SAMPLING_MEAN
            or params.max_decode_token_samples_for_prediction != 0
        ):
            log.warning(
                "deprecated parameters ignored",
                plugin=name,
                detail="samplingMean and maxDecodeTokenSamplesForPrediction are ignored; mid-stream "
                "TPOT predictions were removed",
            )
        self._ttl = ttl
        self._clock = clock
        self._streaming = params.streaming_mode
        self._buffer = params.slo_buffer_factor
        self._role_label = params.endpoint_role_label
        self._predict = params.predict_in_produce
        self._forgetting = params.forgetting_factor
        self._warmup = params.warmup_samples
        self._state_key = f"{TYPE_NAME}/{name}"
        self.pool = _Models(self._forgetting, self._warmup)
        self.endpoint_models: dict[str, _Models] = {}
        self._running: dict[str, _Running] = {}  # by endpoint key
        self.ttft_errors = ErrorWindow(ERROR_WINDOW)
        self.tpot_errors = ErrorWindow(ERROR_WINDOW)
        labels = (name, TYPE_NAME)
        self._h_pred_ttft = PREDICTED_TTFT.labels(*labels)
        self._h_pred_tpot = PREDICTED_TPOT.labels(*labels)
        self._h_ttft_dur = TTFT_PREDICTION_DURATION.labels(*labels)
        self._h_tpot_dur = TPOT_PREDICTION_DURATION.labels(*labels)
        self._c_ttft_violation = SLO_VIOLATIONS.labels(*labels, "ttft")
        self._c_tpot_violation = SLO_VIOLATIONS.labels(*labels, "tpot")
        self._c_ttft_samples = PREDICTOR_SAMPLES.labels(name, "ttft")
        self._c_tpot_samples = PREDICTOR_SAMPLES.labels(name, "tpot")
        # the MAPE series appears with the first scored prediction (absent = no data yet)
        PREDICTOR_MAPE.remove(name, "ttft")
        PREDICTOR_MAPE.remove(name, "tpot")

    # --- produce ------------------------------------------------------------------------------

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        n_input = estimate_input_tokens(request)
        output = 0 if self._streaming else _client_output_cap(request)
        matches = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY) or {}
        loads = cycle.get(INFLIGHT_LOAD_KEY) or {}
        candidates: dict[Endpoint, _Candidate] = {}
        for e in endpoints:
            m = e.metrics
            load = loads.get(e)
            if isinstance(load, InFlightLoad):
                requests, tokens = load.requests, load.tokens
            else:
                requests, tokens = m.running_requests_size, 0
            uncached = uncached_input_tokens(n_input, matches.get(e))
            kv = m.kv_cache_usage_percent
            candidates[e] = _Candidate(
                ttft_features(uncached, requests, tokens, m.waiting_queue_size, kv, output),
                tpot_features(requests, m.waiting_queue_size, kv, n_input),
            )
        pending = _Pending(request.slo_ttft_ms, request.slo_tpot_ms, candidates)
        request.state[self._state_key] = pending
        if self._predict:
            infos = self._predict_all(pending)
            if infos:
                cycle[LATENCY_PREDICTION_INFO_KEY] = infos

    def _predict_all(self, pending: _Pending) -> dict[Endpoint, LatencyPredictionInfo]:
        models = self.endpoint_models
        pool = self.pool
        streaming = self._streaming
        t0 = time.perf_counter()
        for e, c in pending.candidates.items():
            own = models.get(e.metadata.key)
            model = own.ttft if own is not None and own.ttft.warm else pool.ttft
            if model.warm:
                c.ttft = model.predict(c.ttft_x)
        t1 = time.perf_counter()
        if streaming:
            for e, c in pending.candidates.items():
                own = models.get(e.metadata.key)
                model = own.tpot if own is not None and own.tpot.warm else pool.tpot
                if model.warm:
                    c.tpot = model.predict(c.tpot_x)
            self._h_tpot_dur.observe(time.perf_counter() - t1)
        self._h_ttft_dur.observe(t1 - t0)

        out: dict[Endpoint, LatencyPredictionInfo] = {}
        slo_ttft, slo_tpot, buffer = pending.slo_ttft, pending.slo_tpot, self._buffer
        for e, c in pending.candidates.items():
            ttft = c.ttft
            tpot_applies = streaming and not self._is_prefill(e)
            if ttft is None or (tpot_applies and c.tpot is None):
                continue  # no prediction for this endpoint yet
            own = models.get(e.metadata.key)
            source = (
                "endpoint"
                if own is not None and own.ttft.warm and (not tpot_applies or own.tpot.warm)
                else "pool"
            )
            running = self._running.get(e.metadata.key)
            tpot = c.tpot if c.tpot is not None else 0.0
            if tpot_applies:
                buffered = slo_tpot * buffer
                floor = running.min_slo() if running is not None else 0.0
                if floor > 0:
                    buffered = min(buffered, floor * buffer)
                tpot_valid, tpot_headroom = tpot < buffered, buffered - tpot
            else:  # TPOT does not apply: neutral
                tpot_valid, tpot_headroom = True, 0.0
            out[e] = LatencyPredictionInfo(
                ttft_valid=ttft < slo_ttft,
                tpot_valid=tpot_valid,
                ttft_headroom=slo_ttft - ttft,
                tpot_headroom=tpot_headroom,
                ttft=ttft,
                tpot=tpot,
                dispatched_request_count=len(running) if running is not None else 0,
                source=source,
            )
        return out

    def _is_prefill(self, endpoint: Endpoint) -> bool:
        label = self._role_label
        return bool(label) and endpoint.metadata.labels.get(label) == PREFILL_ROLE

    # --- request control ----------------------------------------------------------------------

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        pending: _Pending | None = request.state.get(self._state_key)
        primary = result.primary
        if pending is None or primary is None or not primary.target_endpoints:
            return
        target = primary.target_endpoints[0]
        pending.target = target
        prefill = result.profile_results.get(PREFILL_PROFILE)
        if prefill is not None and prefill.target_endpoints:
            pending.prefill = prefill.target_endpoints[0]
        pending.t_dispatch = self._clock()
        running = self._running.get(target.metadata.key)
        if running is None:
            running = self._running[target.metadata.key] = _Running()
        running.add(request.request_id, pending.slo_tpot)

    def response_body(
        self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None, chunk: bytes
    ) -> None:
        pending: _Pending | None = request.state.get(self._state_key)
        if pending is None or pending.finished or pending.target is None:
            return
        now = self._clock()
        if now - pending.t_dispatch > self._ttl or response.status >= 300:
            self._finish(request, pending)  # too old to learn from (contextTTL), or not a success
            return
        if self._streaming:
            if not request.stream:  # one body: the first token's time is not observable
                if response.end_of_stream:
                    self._finish(request, pending)
                return
            if chunk:
                pending.events += chunk.count(b"data:")
                if not pending.ttft_ms:
                    pending.ttft_ms = (now - pending.t_dispatch) * 1000.0
                    self._learn_ttft(pending, pending.ttft_ms)
            if response.end_of_stream:
                self._learn_tpot(pending, response, now)
                self._finish(request, pending)
        elif response.end_of_stream:
            e2e = (now - pending.t_dispatch) * 1000.0
            pending.ttft_ms = e2e
            self._learn_ttft(pending, e2e)
            self._finish(request, pending)

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        pending: _Pending | None = request.state.pop(self._state_key, None)
        if pending is not None:
            self._finish(request, pending)

    # --- learning -----------------------------------------------------------------------------

    def _models(self, endpoint: Endpoint) -> _Models:
        key = endpoint.metadata.key
        m = self.endpoint_models.get(key)
        if m is None:
            m = self.endpoint_models[key] = _Models(self._forgetting, self._warmup)
        return m

    def _check(self, errors: ErrorWindow, target: str, predicted: float | None, observed: float) -> None:
        """Score the prediction made for this response (if any) and publish the running MAPE."""
        if predicted is None:
            return
        errors.add(predicted, observed)
        mape = errors.mape
        if mape is not None:
            PREDICTOR_MAPE.labels(self.name, target).set(mape)

    def _learn_ttft(self, pending: _Pending, ttft_ms: float) -> None:
        endpoint = pending.prefill or pending.target
        assert endpoint is not None
        c = pending.candidates.get(endpoint)
        if c is None:
            return
        self._check(self.ttft_errors, "ttft", c.ttft, ttft_ms)
        self._models(endpoint).ttft.update(c.ttft_x, ttft_ms)
        self.pool.ttft.update(c.ttft_x, ttft_ms)
        self._c_ttft_samples.inc()

    def _learn_tpot(self, pending: _Pending, response: ResponseInfo, now: float) -> None:
        target = pending.target
        assert target is not None
        if not pending.ttft_ms or self._is_prefill(target):
            return
        usage = response.usage or {}
        tokens = usage.get("completion_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            tokens = pending.events - 1  # one SSE event per token, less the closing [DONE]
        if tokens < 2:
            return
        e2e = (now - pending.t_dispatch) * 1000.0
        tpot = (e2e - pending.ttft_ms) / (tokens - 1)
        if tpot <= 0:
            return
        c = pending.candidates.get(target)
        if c is None:
            return
        self._check(self.tpot_errors, "tpot", c.tpot, tpot)
        self._models(target).tpot.update(c.tpot_x, tpot)
        self.pool.tpot.update(c.tpot_x, tpot)
        self._c_tpot_samples.inc()
        if pending.slo_tpot > 0 and tpot > pending.slo_tpot:
            self._c_tpot_violation.inc()
        if c.tpot is not None:
            self._h_pred_tpot.observe(c.tpot / 1000.0)

    def _finish(self, request: LLMRequest, pending: _Pending) -> None:
        if pending.finished:
            return
        pending.finished = True
        target = pending.target
        if target is None:
            return
        key = target.metadata.key
        running = self._running.get(key)
        if running is not None:
            running.remove(request.request_id)
            if not running:
                del self._running[key]
        if pending.ttft_ms:
            if pending.slo_ttft > 0 and pending.ttft_ms > pending.slo_ttft:
                self._c_ttft_violation.inc()
            c = pending.candidates.get(pending.prefill or target)
            if c is not None and c.ttft is not None:
                self._h_pred_ttft.observe(c.ttft / 1000.0)

    # --- state --------------------------------------------------------------------------------

    def dispatched(self, key: str) -> int:
        """Requests routed to endpoint ``key`` by this producer that have not finished."""
        running = self._running.get(key)
        return len(running) if running else 0

    def remove_endpoint(self, key: str) -> None:
        """Forget an endpoint that left the pool (its models and running requests)."""
        self.endpoint_models.pop(key, None)
        self._running.pop(key, None)
