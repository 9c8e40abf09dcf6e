"""``predicted-latency-producer``: the online regression, warm-up, learning from responses, headroom."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp import promlite
from epp.framework import (
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    ResponseInfo,
    SchedulingResult,
)
from epp.framework.attributes import (
    INFLIGHT_LOAD_KEY,
    LATENCY_PREDICTION_INFO_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
    InFlightLoad,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from epp.plugins.producers._latency_model import ErrorWindow, OnlineRidge
from epp.plugins.producers.predicted_latency import (
    RIDGE,
    TTFT_DIM,
    PredictedLatencyParams,
    PredictedLatencyProducer,
    ttft_features,
)
from tests.unit.factories import completions, config, config_error, endpoint, known_metrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# --- the regression -----------------------------------------------------------------------------


def _synthetic(rng: random.Random, theta: list[float], sigma: float) -> tuple[list[float], float, float]:
    """Features of a random request/load, the noiseless latency and a noisy observation of it."""
    x = ttft_features(
        uncached=rng.randint(0, 4000),
        requests=rng.randint(0, 12),
        inflight_tokens=rng.randint(0, 20000),
        waiting=rng.randint(0, 4),
        kv=rng.random(),
        output=0,
    )
    clean = sum(t * v for t, v in zip(theta, x, strict=True))
    return x, clean, clean + rng.gauss(0.0, sigma)


def test_online_ridge_converges_to_a_known_linear_model() -> None:
    rng = random.Random(7)
    # 40 ms overhead, 60 ms per 1000 uncached tokens, 5 ms per running request, 6 ms per (1000 tokens x
    # request), 8 ms per waiting request, 20 ms at full KV, 2 ms per 1000 in-flight tokens
    theta = [40.0, 60.0, 5.0, 6.0, 8.0, 20.0, 2.0, 0.0, 0.0]
    sigma = 10.0
    model = OnlineRidge(TTFT_DIM, forgetting=0.995, ridge=RIDGE, warmup=20)
    for _ in range(3000):
        x, _, y = _synthetic(rng, theta, sigma)
        model.update(x, y)
    learned, oracle = ErrorWindow(1000), ErrorWindow(1000)
    for _ in range(1000):
        x, clean, y = _synthetic(rng, theta, sigma)
        learned.add(model.predict(x), y)
        oracle.add(clean, y)  # the error the noise alone causes
    assert learned.mape is not None and oracle.mape is not None
    assert learned.mape <= oracle.mape * 1.15 + 0.005, (learned.mape, oracle.mape)
    assert model.theta[1] == pytest.approx(60.0, rel=0.15)


def test_online_ridge_forgets_an_old_regime() -> None:
    rng = random.Random(3)
    model = OnlineRidge(TTFT_DIM, forgetting=0.98, ridge=RIDGE, warmup=5)
    for theta in ([100.0, 10.0, 0, 0, 0, 0, 0, 0, 0], [300.0, 10.0, 0, 0, 0, 0, 0, 0, 0]):
        for _ in range(600):
            x, _, y = _synthetic(rng, theta, 1.0)
            model.update(x, y)
    x = ttft_features(1000, 0, 0, 0, 0.0, 0)
    assert model.predict(x) == pytest.approx(310.0, rel=0.05)


def test_online_ridge_is_not_warm_before_its_samples_and_never_predicts_negative() -> None:
    model = OnlineRidge(3, forgetting=1.0, ridge=1.0, warmup=4)
    for i in range(3):
        model.update([1.0, float(i), 0.0], 10.0 * i)
        assert not model.warm
    model.update([1.0, 3.0, 0.0], 30.0)
    assert model.warm
    assert model.predict([1.0, -100.0, 0.0]) == 0.0


def test_error_window_is_a_sliding_mean() -> None:
    w = ErrorWindow(2)
    assert w.mape is None
    w.add(110.0, 100.0)  # 10 %
    w.add(100.0, 100.0)  # 0 %
    assert w.mape == pytest.approx(0.05)
    w.add(150.0, 100.0)  # 50 %; the 10 % falls out
    assert w.mape == pytest.approx(0.25)


# --- the producer -------------------------------------------------------------------------------

FAST = {"base": 20.0, "per_token": 0.05, "tpot": 5.0}  # ms, ms per uncached token, ms per token
SLOW = {"base": 200.0, "per_token": 0.5, "tpot": 40.0}


def _request(
    rid: str, *, size: int = 2000, stream: bool = True, slo_ttft: float = 0.0, slo_tpot: float = 0.0
) -> LLMRequest:
    r = completions("p", request_id=rid, size=size, stream=stream)
    r.body.stream = stream
    r.slo_ttft_ms = slo_ttft
    r.slo_tpot_ms = slo_tpot
    return r


def _result(target: Endpoint) -> SchedulingResult:
    return SchedulingResult({"default": ProfileRunResult([target])}, "default")


def _produce(
    p: PredictedLatencyProducer, request: LLMRequest, eps: list[Endpoint], cycle: CycleState | None = None
) -> CycleState:
    cycle = cycle if cycle is not None else CycleState()
    asyncio.run(p.produce(cycle, request, eps))
    return cycle


def _serve(
    p: PredictedLatencyProducer,
    clock: Clock,
    request: LLMRequest,
    cycle: CycleState,
    target: Endpoint,
    ttft_ms: float,
    tpot_ms: float,
    tokens: int = 11,
) -> None:
    """Dispatch to ``target`` and stream a response: first token after ``ttft_ms``, then ``tokens - 1``
    more at ``tpot_ms`` each, with usage on the last chunk."""
    result = _result(target)
    p.pre_request(cycle, request, result)
    response = ResponseInfo(status=200)
    clock.t += ttft_ms / 1000.0
    p.response_body(request, response, target, b'data: {"choices":[{"text":"a"}]}\n\n')
    clock.t += tpot_ms * (tokens - 1) / 1000.0
    response.usage = {"prompt_tokens": 10, "completion_tokens": tokens}
    response.end_of_stream = True
    p.response_body(request, response, target, b"data: [DONE]\n\n")
    p.request_done(request, result)


def _speed(e: Endpoint, fast: Endpoint) -> dict[str, float]:
    return FAST if e is fast else SLOW


def _train(
    p: PredictedLatencyProducer, clock: Clock, eps: list[Endpoint], n: int, rng: random.Random
) -> None:
    fast = eps[0]
    for i in range(n):
        size = rng.randint(400, 8000)
        r = _request(f"t{i}-{id(p)}", size=size)
        cycle = _produce(p, r, eps)
        target = eps[i % len(eps)]
        s = _speed(target, fast)
        _serve(p, clock, r, cycle, target, s["base"] + s["per_token"] * size / 4, s["tpot"])


def _producer(clock: Clock, **params: object) -> PredictedLatencyProducer:
    defaults: dict[str, object] = {"streaming_mode": True, "warmup_samples": 5}
    defaults.update(params)
    return PredictedLatencyProducer("plp", PredictedLatencyParams(**defaults), clock=clock)  # type: ignore[arg-type]


def _mape_series() -> dict[str, float]:
    page = promlite.exposition().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(page):
        if fam.name == "llm_d_epp_latency_predictor_mape":
            for s in fam.samples:
                if s.labels.get("plugin_name") == "plp":
                    out[s.labels["target"]] = s.value
    return out


def test_no_prediction_before_warm_up_then_per_endpoint_predictions() -> None:
    clock = Clock()
    p = _producer(clock)
    eps = [endpoint("fast"), endpoint("slow", "10.0.0.2")]
    cycle = _produce(p, _request("first"), eps)
    assert LATENCY_PREDICTION_INFO_KEY not in cycle  # nothing learned yet: no numbers at all
    assert "ttft" not in _mape_series()

    _train(p, clock, eps, 40, random.Random(1))
    cycle = _produce(p, _request("probe", size=4000), eps)
    infos = cycle[LATENCY_PREDICTION_INFO_KEY]
    fast, slow = infos[eps[0]], infos[eps[1]]
    assert isinstance(fast, LatencyPredictionInfo) and fast.source == "endpoint"
    assert fast.ttft == pytest.approx(FAST["base"] + FAST["per_token"] * 1000, rel=0.05)
    assert slow.ttft == pytest.approx(SLOW["base"] + SLOW["per_token"] * 1000, rel=0.05)
    assert fast.tpot == pytest.approx(FAST["tpot"], rel=0.05)
    assert slow.tpot == pytest.approx(SLOW["tpot"], rel=0.05)
    early = _mape_series()  # includes the pool model's guesses while the endpoints warmed up
    _train(p, clock, eps, 220, random.Random(11))  # the window now holds only warm predictions
    mape = _mape_series()
    assert 0.0 <= mape["ttft"] < 0.02 and 0.0 <= mape["tpot"] < 0.02
    assert mape["ttft"] < early["ttft"]


def test_headroom_is_slo_minus_prediction_and_no_slo_means_negative() -> None:
    clock = Clock()
    p = _producer(clock)
    eps = [endpoint("fast"), endpoint("slow", "10.0.0.2")]
    _train(p, clock, eps, 30, random.Random(2))
    cycle = _produce(p, _request("slo", size=4000, slo_ttft=1000.0, slo_tpot=20.0), eps)
    fast, slow = (cycle[LATENCY_PREDICTION_INFO_KEY][e] for e in eps)
    assert fast.ttft_headroom == pytest.approx(1000.0 - fast.ttft)
    assert fast.tpot_headroom == pytest.approx(20.0 - fast.tpot)
    assert fast.valid and slow.ttft_valid and not slow.tpot_valid
    assert slow.tpot_headroom < 0

    cycle = _produce(p, _request("none", size=4000), eps)
    for info in cycle[LATENCY_PREDICTION_INFO_KEY].values():
        assert info.ttft_headroom == pytest.approx(-info.ttft) and info.tpot_headroom == pytest.approx(
            -info.tpot
        )
        assert not info.valid


def test_tpot_slo_is_capped_by_the_tightest_running_request_and_buffered() -> None:
    clock = Clock()
    p = _producer(clock, slo_buffer_factor=2.0)
    eps = [endpoint("fast"), endpoint("slow", "10.0.0.2")]
    _train(p, clock, eps, 30, random.Random(3))
    tight = _request("tight", slo_tpot=3.0)
    p.pre_request(_produce(p, tight, eps), tight, _result(eps[0]))  # still running on fast
    cycle = _produce(p, _request("loose", slo_tpot=100.0, slo_ttft=1e6), eps)
    fast, slow = (cycle[LATENCY_PREDICTION_INFO_KEY][e] for e in eps)
    assert fast.tpot_headroom == pytest.approx(3.0 * 2.0 - fast.tpot)  # min(100, 3) x buffer
    assert slow.tpot_headroom == pytest.approx(100.0 * 2.0 - slow.tpot)
    assert fast.dispatched_request_count == 1 and slow.dispatched_request_count == 0
    p.request_done(tight, _result(eps[0]))  # the tight request ends: no more cap
    fast = _produce(p, _request("after", slo_tpot=100.0, slo_ttft=1e6), eps)[LATENCY_PREDICTION_INFO_KEY][
        eps[0]
    ]
    assert fast.tpot_headroom == pytest.approx(100.0 * 2.0 - fast.tpot)
    assert fast.dispatched_request_count == 0


def test_pool_model_predicts_for_a_new_endpoint_until_its_own_warms_up() -> None:
    clock = Clock()
    p = _producer(clock)
    eps = [endpoint("fast"), endpoint("slow", "10.0.0.2")]
    _train(p, clock, eps, 20, random.Random(4))
    new = endpoint("new", "10.0.0.3")
    info = _produce(p, _request("n"), [*eps, new])[LATENCY_PREDICTION_INFO_KEY][new]
    assert info.source == "pool"


def test_non_streaming_mode_learns_e2e_and_neutralises_tpot() -> None:
    clock = Clock()
    p = _producer(clock, streaming_mode=False)
    eps = [endpoint("only")]
    for i in range(10):
        r = _request(f"e{i}", size=4000, stream=False)
        cycle = _produce(p, r, eps)
        p.pre_request(cycle, r, _result(eps[0]))
        clock.t += 0.3
        p.response_body(r, ResponseInfo(status=200, end_of_stream=True), eps[0], b"{}")
    info = _produce(p, _request("q", size=4000, stream=False, slo_ttft=250.0), eps)[
        LATENCY_PREDICTION_INFO_KEY
    ][eps[0]]
    assert info.ttft == pytest.approx(300.0, rel=0.02)
    assert info.tpot_valid and info.tpot_headroom == 0.0 and not info.ttft_valid


def test_streaming_mode_does_not_learn_from_a_non_streamed_response_errors_or_old_requests() -> None:
    clock = Clock()
    p = _producer(clock, context_ttl="10s")
    e = endpoint("only")
    samples = p.pool.ttft.samples

    one_body = _request("body", stream=False)
    cycle = _produce(p, one_body, [e])
    p.pre_request(cycle, one_body, _result(e))
    clock.t += 0.5
    p.response_body(one_body, ResponseInfo(status=200, end_of_stream=True), e, b"{}")

    failed = _request("failed")
    cycle = _produce(p, failed, [e])
    p.pre_request(cycle, failed, _result(e))
    p.response_body(failed, ResponseInfo(status=503), e, b'{"error": "x"}')

    old = _request("old")
    _serve(p, clock, old, _produce(p, old, [e]), e, ttft_ms=20_000.0, tpot_ms=1.0)
    assert p.pool.ttft.samples == samples and p.pool.tpot.samples == 0
    assert p.dispatched(e.metadata.key) == 0


def test_prefill_role_endpoints_have_neutral_tpot() -> None:
    clock = Clock()
    p = _producer(clock, endpoint_role_label="llm-d.ai/role")
    pre = endpoint("pre", labels={"llm-d.ai/role": "prefill"})
    dec = endpoint("dec", "10.0.0.2", labels={"llm-d.ai/role": "decode"})
    _train(p, clock, [dec, pre], 20, random.Random(5))
    infos = _produce(p, _request("q", slo_tpot=1.0, slo_ttft=1e6), [dec, pre])[LATENCY_PREDICTION_INFO_KEY]
    assert infos[pre].tpot_valid and infos[pre].tpot_headroom == 0.0
    assert not infos[dec].tpot_valid


def test_features_use_uncached_tokens_and_inflight_load() -> None:
    clock = Clock()
    p = _producer(clock)
    e = endpoint("e", metrics=known_metrics(waiting_queue_size=3, kv_cache_usage_percent=0.5))
    cycle = CycleState()
    cycle[PREFIX_CACHE_MATCH_INFO_KEY] = {
        e: PrefixCacheMatchInfo(match_blocks=30, total_blocks=40, block_size_tokens=16)
    }
    cycle[INFLIGHT_LOAD_KEY] = {e: InFlightLoad(tokens=5000, requests=4)}
    r = _request("f", size=2560)  # 640 tokens: 480 cached, 160 not
    _produce(p, r, [e], cycle)
    pending = r.state["predicted-latency-producer/plp"]
    x = pending.candidates[e].ttft_x
    assert x[:7] == pytest.approx([1.0, 0.16, 4.0, 0.64, 3.0, 0.5, 5.0])


def test_predict_in_produce_false_trains_without_writing_predictions() -> None:
    clock = Clock()
    p = _producer(clock, predict_in_produce=False)
    eps = [endpoint("fast"), endpoint("slow", "10.0.0.2")]
    _train(p, clock, eps, 20, random.Random(6))
    assert p.pool.ttft.samples == 20
    assert LATENCY_PREDICTION_INFO_KEY not in _produce(p, _request("q"), eps)


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("sloBufferFactor: 0", "sloBufferFactor"),
        ("contextTTL: soon", "contextTTL"),
        ("useEncoderCacheFeatures: true", "useEncoderCacheFeatures"),
        ("warmupSamples: 0", "warmupSamples"),
        ("forgettingFactor: 1.5", "forgettingFactor"),
        ("streamingMode: yes please", "streamingMode"),
    ],
)
def test_invalid_parameters_name_the_field(params: str, field: str) -> None:
    err = config_error(
        f"""
plugins:
- type: predicted-latency-producer
  parameters: {{{params}}}
- type: latency-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: latency-scorer
"""
    )
    assert field in str(err)


def test_reference_parameters_load_and_deprecated_ones_are_accepted() -> None:
    loaded = config(
        """
plugins:
- type: predicted-latency-producer
  parameters:
    samplingMean: 50
    maxDecodeTokenSamplesForPrediction: 3
    sloBufferFactor: 0.9
    contextTTL: 30s
    streamingMode: true
    endpointRoleLabel: llm-d.ai/role
    predictInProduce: true
    useEncoderCacheFeatures: false
    encoderCacheMatchInfoProducerName: ""
- type: slo-headroom-tier-filter
- type: latency-scorer
- type: latency-slo-admitter
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: latency-scorer
"""
    )
    types = {p.type_name for p in loaded.plugins.values()}
    # the producer's inputs are created for it
    assert {"approx-prefix-cache-producer", "inflight-load-producer", "latency-slo-admitter"} <= types
