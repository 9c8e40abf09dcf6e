"""``concurrency-detector``: saturation and filtering from the EPP's own in-flight requests and tokens."""

from __future__ import annotations

import pytest
import yaml

from epp.config.loader import load_document
from epp.framework import ConfigError, CycleState, Endpoint, LLMRequest, ProfileRunResult, SchedulingResult
from epp.framework.params import decode_params
from epp.plugins.producers.inflight_load import InFlightLoadProducer, estimate_tokens
from epp.plugins.saturation.concurrency_detector import ConcurrencyDetector, ConcurrencyDetectorParams
from tests.unit.factories import StubHandle, completions, endpoints


def _detector(producer: InFlightLoadProducer | None = None, **params: object) -> ConcurrencyDetector:
    p = decode_params(ConcurrencyDetectorParams, params, "parameters")
    handle = StubHandle(producer) if producer is not None else StubHandle()
    return ConcurrencyDetector("cd", p, handle)


def _route(
    producer: InFlightLoadProducer, target: Endpoint, prompt: str = "p", n: int = 1
) -> list[tuple[LLMRequest, SchedulingResult]]:
    """Charge ``n`` requests on ``target`` through the producer's PreRequest hook; returns the requests
    (keep them: a request collected without ``request_done`` gives its charges back)."""
    out = []
    for i in range(n):
        req = completions(prompt, request_id=f"r{i}")
        res = SchedulingResult({"decode": ProfileRunResult([target])}, "decode")
        producer.pre_request(CycleState(), req, res)
        out.append((req, res))
    return out


def test_defaults_match_the_reference() -> None:
    p = ConcurrencyDetectorParams()
    assert (p.concurrency_mode, p.max_concurrency, p.max_token_concurrency, p.headroom) == (
        "requests",
        100,
        1_000_000,
        0.0,
    )
    assert ConcurrencyDetector.stability.value == "beta"


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        ({"maxConcurrency": 0}, "maxConcurrency", "maxConcurrency must be strictly positive, got 0"),
        ({"maxTokenConcurrency": -1}, "maxTokenConcurrency", "maxTokenConcurrency must be strictly positive"),
        ({"headroom": -0.1}, "headroom", "headroom must be a non-negative value"),
        ({"concurrencyMode": "bytes"}, "concurrencyMode", "unsupported concurrencyMode: 'bytes'"),
    ],
)
def test_invalid_parameters_name_the_field(params: dict[str, object], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        decode_params(ConcurrencyDetectorParams, params, "parameters")
    assert e.value.field == f"parameters.{field}"
    assert reason in e.value.reason


def test_requests_mode_is_aggregate_inflight_over_aggregate_capacity() -> None:
    producer = InFlightLoadProducer("inflight-load-producer", None)
    eps = endpoints(2)
    det = _detector(producer, maxConcurrency=4)
    assert det.saturation(eps) == 0.0
    _held1 = _route(producer, eps[0], n=3)
    _held2 = _route(producer, eps[1], n=1)
    assert det.saturation(eps) == pytest.approx(4 / 8)
    assert det.saturation([]) == 1.0


def test_tokens_and_hybrid_modes() -> None:
    producer = InFlightLoadProducer("inflight-load-producer", None)
    eps = endpoints(2)
    _held3 = _route(producer, eps[0], "x" * 400, n=4)  # e0: 4 requests and their token estimates
    _held4 = _route(producer, eps[1], "", n=1)  # e1: 1 request, (about) no tokens
    t0, t1 = (producer.load(e.metadata.key).tokens for e in eps)
    assert t0 > 100 * t1 >= 0  # the producer's estimate, whatever its formula
    tok = _detector(producer, concurrencyMode="tokens", maxTokenConcurrency=t0)
    assert tok.saturation(eps) == pytest.approx((t0 + t1) / (2 * t0))
    # hybrid: per endpoint max(request ratio, token ratio), averaged; e0 is full on both dimensions
    hyb = _detector(producer, concurrencyMode="hybrid", maxConcurrency=4, maxTokenConcurrency=t0)
    assert hyb.saturation(eps) == pytest.approx((1.0 + max(0.25, t1 / t0)) / 2)
    # with a large request capacity e0 is full on tokens only: still 1.0 in the mean
    hyb_tokens_first = _detector(
        producer, concurrencyMode="hybrid", maxConcurrency=100, maxTokenConcurrency=t0
    )
    assert hyb_tokens_first.saturation(eps) == pytest.approx((1.0 + max(0.01, t1 / t0)) / 2)
    req = _detector(producer, maxConcurrency=4)
    assert req.saturation(eps) == pytest.approx(5 / 8)
    assert estimate_tokens(completions("x" * 400)) > 0


def test_releases_lower_saturation() -> None:
    producer = InFlightLoadProducer("inflight-load-producer", None)
    eps = endpoints(1)
    det = _detector(producer, maxConcurrency=2)
    charged = _route(producer, eps[0], n=2)
    assert det.saturation(eps) == 1.0
    req, res = charged[0]
    producer.request_done(req, res)
    assert det.saturation(eps) == 0.5


def test_filter_uses_capacity_times_one_plus_headroom() -> None:
    producer = InFlightLoadProducer("inflight-load-producer", None)
    eps = endpoints(3)
    det = _detector(producer, maxConcurrency=10, headroom=0.2)  # limit 12
    _held5 = _route(producer, eps[0], n=11)
    _held6 = _route(producer, eps[1], n=12)
    kept = det.filter(CycleState(), completions("p"), list(eps))
    assert kept == [eps[0], eps[2]]
    # pool saturation uses the ideal capacity, not the burst limit: 23 / 30
    assert det.saturation(eps) == pytest.approx(23 / 30)


def test_hybrid_filter_drops_an_endpoint_full_on_either_dimension() -> None:
    producer = InFlightLoadProducer("inflight-load-producer", None)
    eps = endpoints(3)
    _held7 = _route(producer, eps[0], "x" * 400, n=1)  # 1 request, many tokens
    _held8 = _route(producer, eps[1], "", n=2)  # 2 requests, (about) no tokens
    tokens = producer.load(eps[0].metadata.key).tokens
    assert tokens > producer.load(eps[1].metadata.key).tokens
    det = _detector(producer, concurrencyMode="hybrid", maxConcurrency=2, maxTokenConcurrency=tokens)
    assert det.filter(CycleState(), completions("p"), list(eps)) == [eps[2]]


def test_without_a_producer_requests_come_from_endpoint_inflight() -> None:
    eps = endpoints(2)
    eps[0].inflight = 3
    det = _detector(None, maxConcurrency=2)
    assert det.saturation(eps) == pytest.approx(3 / 4)
    assert det.filter(CycleState(), completions("p"), list(eps)) == [eps[1]]


def test_loaded_as_saturation_detector_it_gets_an_inflight_producer() -> None:
    doc = yaml.safe_load(
        """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: concurrency-detector
  parameters: {concurrencyMode: tokens, maxTokenConcurrency: 500}
saturationDetector: {pluginRef: concurrency-detector}
"""
    )
    cfg = load_document(doc, "test")
    det = cfg.saturation_detector
    assert isinstance(det, ConcurrencyDetector)
    producer = cfg.plugins["inflight-load-producer"]
    assert isinstance(producer, InFlightLoadProducer)
    assert producer in cfg.pre_request
    eps = endpoints(1)
    _held9 = _route(producer, eps[0], "x" * 400, n=1)
    tokens = producer.load(eps[0].metadata.key).tokens
    assert tokens > 0
    assert det.saturation(eps) == pytest.approx(tokens / 500)


def test_named_producer_is_read() -> None:
    doc = yaml.safe_load(
        """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: inflight-load-producer, name: mine}
- type: concurrency-detector
  parameters: {inFlightLoadProducerName: mine, maxConcurrency: 1}
saturationDetector: {pluginRef: concurrency-detector}
"""
    )
    cfg = load_document(doc, "test")
    assert "inflight-load-producer" not in cfg.plugins
    eps = endpoints(1)
    mine = cfg.plugins["mine"]
    assert isinstance(mine, InFlightLoadProducer)
    _held10 = _route(mine, eps[0])
    assert cfg.saturation_detector is not None
    assert cfg.saturation_detector.saturation(eps) == 1.0
