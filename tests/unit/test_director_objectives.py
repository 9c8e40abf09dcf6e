"""The director with InferenceObjective priorities, InferenceModelRewrite rules and legacy admission.

Driven through the real ext_proc handler over gRPC (``extproc_harness``) where the wire matters
(status codes, forwarded bodies, metrics recorded by the stream), and through ``Director.route``
directly for the statistical checks.
"""

from __future__ import annotations

import collections
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from prometheus_client import REGISTRY

from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.rewrites import RewriteStore
from epp.datalayer.store import EndpointStore
from epp.framework import (
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    PreRequest,
    SaturationDetector,
    SchedulingResult,
)
from epp.plugins.saturation.utilization_detector import UtilizationDetector, UtilizationDetectorParams
from epp.server.director import Director
from tests.unit import factories
from tests.unit.extproc_harness import (
    Harness,
    body_msg,
    endpoint,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    set_headers,
    start,
)

POOL = "pool"
CHAT = b'{"model":"demo","messages":[{"role":"user","content":"hi"}]}'
PATH = {":path": "/v1/chat/completions"}
SHED = "inference error: ResourceExhausted - system saturated, sheddable request dropped"


def objective(name: str, priority: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"poolRef": {"group": "inference.networking.k8s.io", "name": POOL}, "priority": priority},
    }


def model_rewrite(name: str, model: str | None, *targets: tuple[str, int]) -> dict[str, Any]:
    rule: dict[str, Any] = {"targets": [{"modelRewrite": t, "weight": w} for t, w in targets]}
    if model is not None:
        rule["matches"] = [{"model": {"type": "Exact", "value": model}}]
    return {
        "metadata": {"name": name, "creationTimestamp": "2025-01-01T00:00:00Z"},
        "spec": {"poolRef": {"name": POOL}, "rules": [rule]},
    }


class Seen(PreRequest):
    """Records the requests that reached PreRequest (i.e. were scheduled)."""

    type_name = "seen"

    def __init__(self) -> None:
        super().__init__("seen", None)
        self.requests: list[LLMRequest] = []

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        self.requests.append(request)


class CountingDetector(SaturationDetector):
    type_name = "counting-detector"

    def __init__(self, value: float) -> None:
        super().__init__("counting", None)
        self.value = value
        self.calls = 0

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        self.calls += 1
        return self.value


class BrokenDetector(SaturationDetector):
    type_name = "broken-detector"

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        raise RuntimeError("boom")


@pytest.fixture
def store() -> EndpointStore:
    s = EndpointStore()
    for i in (1, 2, 3):
        s.upsert(endpoint(i))
    return s


@pytest.fixture
def objectives() -> ObjectiveStore:
    o = ObjectiveStore(pool_name=POOL)
    for obj in (objective("critical", 10), objective("batch", -1), objective("standard", 0)):
        o.upsert_object(obj)
    return o


def fresh_metrics(store: EndpointStore, queue: int = 0, kv: float = 0.0) -> None:
    now = time.monotonic()
    for e in store.endpoints():
        e.metrics = Metrics(waiting_queue_size=queue, kv_cache_usage_percent=kv, update_time=now)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def run(store: EndpointStore) -> AsyncIterator[Any]:
    """``await run(director, messages, expect)``: one ext_proc stream against a fresh server."""
    started: list[Harness] = []

    async def _run(director: Director, messages: list[Any], expect: int) -> list[Any]:
        h = await start(store, director=director)
        started.append(h)
        return await h.exchange(messages, expect=expect)

    yield _run
    for h in started:
        await h.channel.close()
        await h.server.stop(0)


def forwarded_body(out: list[Any]) -> bytes:
    return bytes(out[1].request_body.response.body_mutation.streamed_response.body)


def immediate(reply: Any) -> tuple[int, str]:
    return reply.immediate_response.status.code, json.loads(reply.immediate_response.body)["error"]["message"]


# --- InferenceObjective -------------------------------------------------------------------------


@pytest.mark.parametrize(("header", "priority"), [("critical", 10), ("batch", -1), ("unknown", 0), (None, 0)])
async def test_objective_priority_reaches_the_request_and_the_request_metric(
    store: EndpointStore, objectives: ObjectiveStore, run: Any, header: str | None, priority: int
) -> None:
    seen = Seen()
    director = factories.director(
        store, objectives=objectives, pre_request=[seen]
    )  # no detector: nothing is shed
    labels = {"model_name": "demo", "target_model_name": "demo", "priority": str(priority)}
    before = sample("inference_objective_request_total", **labels)
    headers = {"x-gateway-inference-objective": header} if header is not None else {}
    out = await run(director, [headers_msg(headers), body_msg(CHAT, True)], 2)
    (request,) = seen.requests
    assert request.priority == priority
    assert request.objective == (header or "")
    assert sample("inference_objective_request_total", **labels) == before + 1
    if header is not None:  # consumed by the EPP, not forwarded
        assert (
            "x-gateway-inference-objective" in out[0].request_headers.response.header_mutation.remove_headers
        )


@pytest.mark.parametrize(
    ("headers", "priority", "fairness_id"),
    [
        ({"x-llm-d-inference-objective": "critical"}, 10, "default-flow"),
        ({"x-gateway-inference-objective": "critical"}, 10, "default-flow"),
        (
            {"x-llm-d-inference-objective": "batch", "x-gateway-inference-objective": "critical"},
            -1,
            "default-flow",
        ),
        ({"x-llm-d-inference-fairness-id": "tenant-a"}, 0, "tenant-a"),
        ({"x-gateway-inference-fairness-id": "tenant-b"}, 0, "tenant-b"),
        ({"x-llm-d-inference-fairness-id": "new", "x-gateway-inference-fairness-id": "old"}, 0, "new"),
    ],
)
async def test_llm_d_header_names_come_first_and_the_old_names_are_still_read(
    store: EndpointStore,
    objectives: ObjectiveStore,
    run: Any,
    headers: dict[str, str],
    priority: int,
    fairness_id: str,
) -> None:
    seen = Seen()
    director = factories.director(store, objectives=objectives, pre_request=[seen])
    out = await run(director, [headers_msg(headers), body_msg(CHAT, True)], 2)
    (request,) = seen.requests
    assert (request.priority, request.fairness_id) == (priority, fairness_id)
    removed = set(out[0].request_headers.response.header_mutation.remove_headers)
    assert set(headers) <= removed  # every spelling is consumed by the EPP, none forwarded
    assert not set(headers) & set(request.headers)  # and PreRequest plugins do not see them either


async def test_without_an_objective_store_every_priority_is_zero(store: EndpointStore, run: Any) -> None:
    seen = Seen()
    director = factories.director(store, saturation_detector=CountingDetector(5.0), pre_request=[seen])
    await run(director, [headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(CHAT, True)], 2)
    assert seen.requests[0].priority == 0


async def test_objective_updates_apply_to_the_next_request(
    store: EndpointStore, objectives: ObjectiveStore
) -> None:
    seen = Seen()
    director = factories.director(store, objectives=objectives, pre_request=[seen])
    headers = {"x-gateway-inference-objective": "critical"}
    await director.route({**PATH, **headers}, CHAT, {})
    objectives.upsert_object(objective("critical", 99))
    await director.route({**PATH, **headers}, CHAT, {})
    objectives.delete("critical")
    await director.route({**PATH, **headers}, CHAT, {})
    assert [r.priority for r in seen.requests] == [10, 99, 0]


# --- InferenceModelRewrite ----------------------------------------------------------------------


async def test_rewrite_rule_overrides_the_header_and_is_counted(store: EndpointStore, run: Any) -> None:
    rewrites = RewriteStore(pool_name=POOL)
    rewrites.upsert_object(model_rewrite("demo-upgrade", "demo", ("demo-v2", 1)))
    director = factories.director(store, rewrites=rewrites)
    decision = {"model_rewrite_name": "demo-upgrade", "model_name": "demo", "target_model": "demo-v2"}
    total = {"model_name": "demo", "target_model_name": "demo-v2", "priority": "0"}
    before = sample("inference_extension_model_rewrite_decisions_total", **decision)
    before_total = sample("inference_objective_request_total", **total)
    out = await run(
        director,
        [headers_msg({"x-gateway-model-name-rewrite": "from-header"}), body_msg(CHAT, True)],
        2,
    )
    assert json.loads(forwarded_body(out))["model"] == "demo-v2"
    assert forwarded_body(out) == CHAT.replace(b'"demo"', b'"demo-v2"')  # only the model changed
    assert set_headers(out[0].request_headers.response)["content-length"] == str(len(forwarded_body(out)))
    assert sample("inference_extension_model_rewrite_decisions_total", **decision) == before + 1
    assert sample("inference_objective_request_total", **total) == before_total + 1


async def test_header_applies_when_no_rule_matches_the_incoming_model(store: EndpointStore, run: Any) -> None:
    rewrites = RewriteStore(pool_name=POOL)
    rewrites.upsert_object(model_rewrite("other", "other-model", ("x", 1)))
    director = factories.director(store, rewrites=rewrites)
    out = await run(
        director, [headers_msg({"x-gateway-model-name-rewrite": "from-header"}), body_msg(CHAT, True)], 2
    )
    assert json.loads(forwarded_body(out))["model"] == "from-header"


async def test_rule_is_looked_up_by_the_incoming_model_not_the_header(store: EndpointStore) -> None:
    rewrites = RewriteStore(pool_name=POOL)
    rewrites.upsert_object(model_rewrite("by-header-name", "from-header", ("wrong", 1)))
    seen = Seen()
    director = factories.director(store, rewrites=rewrites, pre_request=[seen])
    routing = await director.route({**PATH, "x-gateway-model-name-rewrite": "from-header"}, CHAT, {})
    assert seen.requests[0].target_model == "from-header"
    assert json.loads(routing.body)["model"] == "from-header"


async def test_rule_without_targets_leaves_the_model_as_sent(store: EndpointStore) -> None:
    """Quirk Q10: the reference would forward ``"model": ""``."""
    rewrites = RewriteStore(pool_name=POOL)
    rewrites.upsert_object(model_rewrite("empty", "demo"))
    director = factories.director(store, rewrites=rewrites)
    routing = await director.route(dict(PATH), CHAT, {})
    assert routing.body == CHAT and not routing.body_changed
    routing = await director.route({**PATH, "x-gateway-model-name-rewrite": "from-header"}, CHAT, {})
    assert json.loads(routing.body)["model"] == "from-header"


async def test_weighted_split_through_the_director(store: EndpointStore) -> None:
    rewrites = RewriteStore(pool_name=POOL)
    rewrites.upsert_object(model_rewrite("canary", "demo", ("demo-stable", 90), ("demo-canary", 10)))
    director = factories.director(store, rewrites=rewrites, rng=random.Random(2024))
    n = 2000
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        routing = await director.route(dict(PATH), CHAT, {})
        assert routing.request is not None
        counts[routing.request.target_model] += 1
        director.release_in_flight(routing)
    assert set(counts) == {"demo-stable", "demo-canary"}
    assert abs(counts["demo-canary"] / n - 0.10) < 0.027  # 4 standard deviations


async def test_store_driven_rewrite_is_reversed_in_the_response_body(store: EndpointStore, run: Any) -> None:
    rewrites = RewriteStore(pool_name=POOL)
    rewrites.upsert_object(model_rewrite("r", "demo", ("demo-v2", 1)))
    director = factories.director(store, rewrites=rewrites)
    out = await run(
        director,
        [
            headers_msg({}),
            body_msg(CHAT, True),
            response_headers_msg(
                {":status": "200", "content-type": "application/json", "content-length": "43"}
            ),
            response_body_msg(b'{"id":"1","model": "demo-v2",', False),
            response_body_msg(b'"choices":[]}', True),
        ],
        4,
    )
    assert json.loads(forwarded_body(out))["model"] == "demo-v2"
    assert "content-length" in out[2].response_headers.response.header_mutation.remove_headers
    final = out[3].response_body.response.body_mutation.streamed_response
    assert final.body == b'{"id":"1","model": "demo","choices":[]}' and final.end_of_stream


async def test_store_driven_rewrite_is_reversed_in_streamed_chunks(store: EndpointStore, run: Any) -> None:
    rewrites = RewriteStore(pool_name=POOL)
    rewrites.upsert_object(model_rewrite("r", None, ("demo-v2", 1)))  # a generic rule
    director = factories.director(store, rewrites=rewrites)
    body = b'{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    out = await run(
        director,
        [
            headers_msg({}),
            body_msg(body, True),
            response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
            response_body_msg(b'data: {"model":"demo-v2","x":1}\n\n', False),
            response_body_msg(b"data: [DONE]\n\n", True),
        ],
        5,
    )
    chunks = [r.response_body.response.body_mutation.streamed_response.body for r in out[3:]]
    assert chunks == [b'data: {"model":"demo","x":1}\n\n', b"data: [DONE]\n\n"]


# --- legacy admission ---------------------------------------------------------------------------


async def test_sheddable_request_is_429_when_saturated(
    store: EndpointStore, objectives: ObjectiveStore, run: Any
) -> None:
    fresh_metrics(store, queue=5)  # q/5 = 1.0 on every endpoint
    seen = Seen()
    director = factories.director(
        store,
        saturation_detector=UtilizationDetector("utilization-detector"),
        objectives=objectives,
        pre_request=[seen],
    )
    (reply,) = await run(
        director, [headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(CHAT, True)], 1
    )
    assert immediate(reply) == (429, SHED)
    sent = {h.header.key for h in reply.immediate_response.headers.set_headers}
    assert "x-llm-d-request-dropped-reason" not in sent  # only flow control sets a reason
    assert not seen.requests
    # the same pool admits a request whose objective is not sheddable
    out = await run(
        director, [headers_msg({"x-gateway-inference-objective": "critical"}), body_msg(CHAT, True)], 2
    )
    assert [r.priority for r in seen.requests] == [10]
    assert out[0].WhichOneof("response") == "request_headers"


async def test_sheddable_request_is_429_when_metrics_are_stale(
    store: EndpointStore, objectives: ObjectiveStore, run: Any
) -> None:
    # The endpoints were never scraped: with stalenessPolicy saturated (the reference's only
    # behaviour) missing metrics count as saturated.
    strict = UtilizationDetectorParams(staleness_policy="saturated")
    director = factories.director(
        store, saturation_detector=UtilizationDetector("utilization-detector", strict), objectives=objectives
    )
    (reply,) = await run(
        director, [headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(CHAT, True)], 1
    )
    assert immediate(reply) == (429, SHED)


async def test_sheddable_request_on_never_scraped_endpoints_follows_the_in_flight_credit(
    store: EndpointStore, objectives: ObjectiveStore, run: Any
) -> None:
    # The default stalenessPolicy (credit): what this EPP has in flight stands in for the metrics.
    director = factories.director(
        store, saturation_detector=UtilizationDetector("utilization-detector"), objectives=objectives
    )
    msgs = [headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(CHAT, True)]
    routed = await run(director, msgs, 2)
    assert routed[0].WhichOneof("response") == "request_headers"  # nothing in flight: admitted
    for e in store.endpoints():
        e.inflight = 5  # queue threshold 5 on every endpoint: saturated
    (reply,) = await run(director, msgs, 1)
    assert immediate(reply) == (429, SHED)


async def test_sheddable_request_is_admitted_when_not_saturated(
    store: EndpointStore, objectives: ObjectiveStore, run: Any
) -> None:
    fresh_metrics(store, queue=4, kv=0.79)  # max(0.8, 0.9875) < 1
    seen = Seen()
    # a generous staleness threshold keeps the test independent of how fast the server starts
    relaxed = UtilizationDetectorParams(metrics_staleness_threshold="60s")
    director = factories.director(
        store,
        saturation_detector=UtilizationDetector("utilization-detector", relaxed),
        objectives=objectives,
        pre_request=[seen],
    )
    out = await run(
        director, [headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(CHAT, True)], 2
    )
    assert out[0].WhichOneof("response") == "request_headers"
    assert [r.priority for r in seen.requests] == [-1]


@pytest.mark.parametrize("header", ["critical", "standard", "unknown", None])
async def test_priority_zero_or_more_is_never_shed_and_never_asks_the_detector(
    store: EndpointStore, objectives: ObjectiveStore, run: Any, header: str | None
) -> None:
    detector = CountingDetector(100.0)
    director = factories.director(store, saturation_detector=detector, objectives=objectives)
    headers = {"x-gateway-inference-objective": header} if header is not None else {}
    out = await run(director, [headers_msg(headers), body_msg(CHAT, True)], 2)
    assert out[0].WhichOneof("response") == "request_headers"
    assert detector.calls == 0


async def test_the_detector_sees_the_candidates(store: EndpointStore, objectives: ObjectiveStore) -> None:
    seen_candidates: list[list[str]] = []

    class Recording(SaturationDetector):
        type_name = "recording"

        def saturation(self, endpoints: Sequence[Endpoint]) -> float:
            seen_candidates.append(sorted(e.hostport for e in endpoints))
            return 0.0

    director = factories.director(store, saturation_detector=Recording("r", None), objectives=objectives)
    subset = {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["10.0.0.2"]}}
    await director.route({**PATH, "x-gateway-inference-objective": "batch"}, CHAT, subset)
    assert seen_candidates == [["10.0.0.2:8000"]]


async def test_sheddable_request_with_no_candidates_is_shed_first(
    store: EndpointStore, objectives: ObjectiveStore, run: Any
) -> None:
    """As in the reference, admission comes before the empty-candidates check (saturation of none = 1)."""
    director = factories.director(
        store, saturation_detector=UtilizationDetector("utilization-detector"), objectives=objectives
    )
    msgs = [
        headers_msg({"x-gateway-inference-objective": "batch"}, subset=["10.9.9.9"]),
        body_msg(CHAT, True),
    ]
    (reply,) = await run(director, msgs, 1)
    assert immediate(reply) == (429, SHED)
    msgs = [
        headers_msg({"x-gateway-inference-objective": "critical"}, subset=["10.9.9.9"]),
        body_msg(CHAT, True),
    ]
    (reply,) = await run(director, msgs, 1)
    assert immediate(reply)[0] == 503


async def test_a_failing_detector_admits(store: EndpointStore, objectives: ObjectiveStore, run: Any) -> None:
    director = factories.director(
        store, saturation_detector=BrokenDetector("broken", None), objectives=objectives
    )
    out = await run(
        director, [headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(CHAT, True)], 2
    )
    assert out[0].WhichOneof("response") == "request_headers"


async def test_without_a_detector_nothing_is_shed(
    store: EndpointStore, objectives: ObjectiveStore, run: Any
) -> None:
    director = factories.director(store, objectives=objectives)
    out = await run(
        director, [headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(CHAT, True)], 2
    )
    assert out[0].WhichOneof("response") == "request_headers"
