"""Request-control extension points and plugins: request-header processors (``agent-identity``),
screeners, ``probabilistic-admitter`` and ``request-attribute-reporter``.

The director is driven through ``Director.route``; the reporter's metadata through the real
ext_proc handler over gRPC (``extproc_harness``).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import AsyncIterator

import pytest
from google.protobuf.json_format import MessageToDict

from epp import promlite
from epp.config.loader import load_config
from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.store import EndpointStore
from epp.framework import (
    ConfigError,
    Endpoint,
    ErrorCode,
    InferenceError,
    LLMRequest,
    RequestHeaderProcessor,
    ResponseInfo,
    Screener,
)
from epp.framework.attributes import AGENT_IDENTITY_KEY
from epp.framework.params import decode_params
from epp.plugins.request_control.agent_identity import AgentIdentity, AgentIdentityParams
from epp.plugins.request_control.disaggregatedset_rollout_screener import (
    DEFAULT_REVISION_LABEL,
    DEFAULT_ROLE_LABEL,
    DisaggregatedSetRolloutScreener,
    DisaggregatedSetRolloutScreenerParams,
    parse_label_selector,
)
from epp.plugins.request_control.probabilistic_admitter import (
    ProbabilisticAdmitter,
    ProbabilisticAdmitterParams,
)
from epp.plugins.request_control.request_attribute_reporter import (
    RequestAttributeReporter,
    RequestAttributeReporterParams,
)
from epp.server.director import Director, DirectorHooks
from epp.server.extproc import StreamOptions
from tests.unit import factories
from tests.unit.extproc_harness import (
    Harness,
    body_msg,
    endpoint,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    start,
)

CHAT = b'{"model":"demo","messages":[{"role":"user","content":"hi"}]}'
POOL = "pool"
PATH = {":path": "/v1/chat/completions"}


def _store(n: int = 3) -> EndpointStore:
    store = EndpointStore()
    for i in range(1, n + 1):
        store.upsert(endpoint(i))
    return store


def _director(store: EndpointStore, **hooks: object) -> Director:
    base = factories.director(store)
    base.hooks = DirectorHooks(**hooks)  # type: ignore[arg-type]
    return base


# --- agent-identity ----------------------------------------------------------------------------


def _agent(*extra: str) -> AgentIdentity:
    return AgentIdentity("agent-identity", AgentIdentityParams(tuple(extra)))


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-claude-code-session-id": "cc", "x-session-affinity": "oc", "session-id": "cx"}, "cc"),
        ({"x-session-affinity": "oc", "session-id": "cx", "session_id": "old"}, "oc"),
        ({"session-id": "cx", "session_id": "old"}, "cx"),
        ({"session_id": "old"}, "old"),
        ({"x-claude-code-session-id": "", "session_id": "old"}, "old"),  # empty values are skipped
        ({"x-other": "v"}, None),
    ],
)
def test_agent_identity_takes_the_first_non_empty_session_header(
    headers: dict[str, str], expected: str | None
) -> None:
    request = factories.request(headers=headers)
    _agent().request_header(request)
    assert request.state.get(AGENT_IDENTITY_KEY) == expected


def test_agent_identity_checks_additional_headers_first_case_insensitively() -> None:
    plugin = _agent("X-My-Agent-Session")
    request = factories.request(headers={"x-my-agent-session": "mine", "x-claude-code-session-id": "cc"})
    plugin.request_header(request)
    assert request.state[AGENT_IDENTITY_KEY] == "mine"
    assert plugin.headers[0] == "x-my-agent-session" and "session_id" in plugin.headers


async def test_agent_identity_becomes_the_fairness_id_unless_a_fairness_header_was_sent() -> None:
    director = _director(_store(), request_header=[_agent()])
    seen: list[LLMRequest] = []

    class Spy(RequestHeaderProcessor):
        type_name = "spy"

        def request_header(self, request: LLMRequest) -> None:
            seen.append(request)

    director.hooks.request_header = [_agent(), Spy("spy", None)]
    r = await director.route({**PATH, "x-claude-code-session-id": "sess-1"}, CHAT, {})
    assert r.request is not None and r.request.fairness_id == "sess-1"
    r = await director.route(
        {**PATH, "x-claude-code-session-id": "sess-1", "x-llm-d-inference-fairness-id": "tenant-a"}, CHAT, {}
    )
    assert r.request is not None and r.request.fairness_id == "tenant-a"
    r = await director.route(dict(PATH), CHAT, {})
    assert r.request is not None and r.request.fairness_id == "default-flow"
    assert len(seen) == 3  # every processor ran, in order, once per request


async def test_request_header_processor_runs_before_shedding_and_its_error_rejects() -> None:
    class Reject(RequestHeaderProcessor):
        type_name = "reject"

        def request_header(self, request: LLMRequest) -> None:
            if request.headers.get("x-block"):
                raise InferenceError(ErrorCode.FORBIDDEN, "blocked")

    class Broken(RequestHeaderProcessor):
        type_name = "broken"

        def request_header(self, request: LLMRequest) -> None:
            raise RuntimeError("boom")

    empty = _director(EndpointStore(), request_header=[Reject("r", None)])
    with pytest.raises(InferenceError) as e:  # before the candidates: 403, not 503
        await empty.route({**PATH, "x-block": "1"}, CHAT, {})
    assert e.value.code is ErrorCode.FORBIDDEN
    broken = _director(_store(), request_header=[Broken("b", None)])
    with pytest.raises(InferenceError) as e:
        await broken.route(dict(PATH), CHAT, {})
    assert e.value.code is ErrorCode.INTERNAL and "b/broken" in e.value.message


def test_agent_identity_loads_from_the_reference_readme_configs() -> None:
    cfg = load_config(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: agent-identity\n"
        "  parameters:\n    additionalSessionHeaders: [x-my-agent-session]\n"
    )
    assert [p.type_name for p in cfg.request_header] == ["agent-identity"]
    with pytest.raises(ConfigError, match="additionalSessionHeaders"):
        load_config(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: agent-identity\n"
            "  parameters:\n    additionalSessionHeaders: x-one\n"
        )


# --- screeners ---------------------------------------------------------------------------------


class _Keep(Screener):
    type_name = "keep"

    def __init__(self, name: str, keep: set[str]) -> None:
        super().__init__(name, None)
        self.keep = keep
        self.inputs: list[list[str]] = []

    def screen(self, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        self.inputs.append([e.metadata.name for e in endpoints])
        return [e for e in endpoints if e.metadata.name in self.keep]


async def test_screeners_see_the_same_candidates_and_the_director_intersects_them() -> None:
    a, b = _Keep("a", {"ep-1", "ep-2"}), _Keep("b", {"ep-2", "ep-3"})
    director = _director(_store(), screeners=[a, b])
    for _ in range(5):
        r = await director.route(dict(PATH), CHAT, {})
        assert [e.metadata.name for e in r.endpoints] == ["ep-2"]
    assert a.inputs[0] == b.inputs[0] == ["ep-1", "ep-2", "ep-3"]


async def test_screeners_leaving_nothing_fail_with_503() -> None:
    director = _director(_store(), screeners=[_Keep("a", {"ep-1"}), _Keep("b", {"ep-3"})])
    with pytest.raises(InferenceError) as e:
        await director.route(dict(PATH), CHAT, {})
    assert e.value.code is ErrorCode.SERVICE_UNAVAILABLE
    assert e.value.message == "screeners eliminated all endpoint candidates"


# --- probabilistic-admitter --------------------------------------------------------------------


def _loaded(waiting: int = 0, kv: float = 0.0, n: int = 4) -> list[Endpoint]:
    m = factories.known_metrics(waiting_queue_size=waiting, kv_cache_usage_percent=kv, update_time=1.0)
    return factories.endpoints(n, metrics=m)


def _admitter(seed: int = 1, **params: float) -> ProbabilisticAdmitter:
    return ProbabilisticAdmitter("pa", ProbabilisticAdmitterParams(**params), rng=random.Random(seed))  # type: ignore[arg-type]


def test_probabilistic_admitter_curve_and_saturation() -> None:
    a = _admitter()
    # mean over endpoints of max(queue/5, kv/0.8); a never-scraped endpoint counts as 1.0
    assert a.saturation(_loaded(waiting=1)) == pytest.approx(0.2)
    assert a.saturation(_loaded(kv=0.4)) == pytest.approx(0.5)
    mixed = [*_loaded(n=1), factories.endpoint("never")]
    assert a.saturation(mixed) == pytest.approx(0.5)
    assert a.probability(0.15) == pytest.approx(0.15**5 * 300)  # ~2.3%
    assert a.probability(0.34) == 1.0
    assert a.probability(0.0) == 0.0


def test_probabilistic_admitter_sheds_only_sheddable_requests_at_the_curve_rate() -> None:
    a = _admitter(seed=42)
    eps = _loaded(waiting=1)  # saturation 0.2: p = 0.2**5 * 300 = 0.096
    sheddable = factories.request()
    sheddable.priority = -1
    denials = [a.admit(None, sheddable, eps) for _ in range(4000)]  # type: ignore[arg-type]
    rate = sum(d is not None for d in denials) / len(denials)
    assert 0.08 < rate < 0.115
    first = next(d for d in denials if d is not None)
    assert first.code is ErrorCode.RESOURCE_EXHAUSTED and first.code.http_status == 429
    assert first.headers == {"x-llm-d-request-dropped-reason": "rejected-saturated"}
    assert "saturation=0.200 prob=0.10" in first.message
    critical = factories.request()
    assert all(a.admit(None, critical, _loaded(waiting=50)) is None for _ in range(200))  # type: ignore[arg-type]
    assert a.admit(None, sheddable, []) is None  # type: ignore[arg-type]
    # the same seed gives the same decisions
    b = _admitter(seed=42)
    assert [b.admit(None, sheddable, eps) is None for _ in range(4000)] == [d is None for d in denials]  # type: ignore[arg-type]


def test_probabilistic_admitter_parameters() -> None:
    p = decode_params(ProbabilisticAdmitterParams, {}, "p")
    assert (p.queue_depth_threshold, p.kv_cache_util_threshold, p.power, p.k) == (5, 0.8, 5.0, 300.0)
    for key, bad in (("queueDepthThreshold", 0), ("kvCacheUtilThreshold", 0.0), ("power", -1.0), ("k", 0)):
        with pytest.raises(ConfigError) as e:
            decode_params(ProbabilisticAdmitterParams, {key: bad}, "p")
        assert e.value.field == f"p.{key}" and "must be > 0" in e.value.reason


async def test_probabilistic_admitter_in_the_director_rejects_sheddable_with_429() -> None:
    store = EndpointStore()
    store.upsert(endpoint(1))  # never scraped: saturation 1.0, p = 1
    objectives = ObjectiveStore(POOL)
    objectives.upsert_object(
        {
            "metadata": {"name": "batch"},
            "spec": {"poolRef": {"group": "inference.networking.k8s.io", "name": POOL}, "priority": -1},
        }
    )
    director = factories.director(store, objectives=objectives)
    director.hooks = DirectorHooks(admitters=[_admitter()])
    with pytest.raises(InferenceError) as e:
        await director.route({**PATH, "x-gateway-inference-objective": "batch"}, CHAT, {})
    assert e.value.code.http_status == 429
    assert e.value.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    routed = await director.route(dict(PATH), CHAT, {})  # priority 0 is admitted
    assert routed.endpoints


# --- request-attribute-reporter ----------------------------------------------------------------


def _reporter(*attributes: dict[str, object]) -> RequestAttributeReporter:
    params = decode_params(RequestAttributeReporterParams, {"attributes": list(attributes)}, "p")
    return RequestAttributeReporter("cost", params)


TOTAL: dict[str, object] = {
    "key": {"name": "x-gateway-inference-request-cost"},
    "expression": "usage.prompt_tokens + usage.completion_tokens",
    "condition": "has(usage.prompt_tokens) && has(usage.completion_tokens)",
}


def test_reporter_evaluates_expression_and_condition_over_usage() -> None:
    r = _reporter(
        TOTAL,
        {
            "key": {"namespace": "acme", "name": "cached"},
            "expression": "usage.prompt_tokens_details.cached_tokens",
            "condition": "has(usage.prompt_tokens_details)",
        },
    )
    usage: dict[str, object] = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert r.evaluate(usage) == [("envoy.lb", "x-gateway-inference-request-cost", 12.0)]
    usage["prompt_tokens_details"] = {"cached_tokens": 4}
    assert r.evaluate(usage)[1] == ("acme", "cached", 4.0)
    assert r.evaluate(None) == []  # zero is not reported
    half = _reporter({"key": {"name": "k"}, "expression": "usage.completion_tokens / 2.0"})
    assert half.evaluate({"completion_tokens": 5}) == [("envoy.lb", "k", 2.0)]  # truncated
    off = _reporter(
        {"key": {"name": "k"}, "expression": "usage.total_tokens", "condition": "usage.total_tokens > 100"}
    )
    assert off.evaluate({"total_tokens": 50}) == [] and off.evaluate({"total_tokens": 150}) == [
        ("envoy.lb", "k", 150.0)
    ]


def test_reporter_skips_non_numbers_and_runtime_errors() -> None:
    text = _reporter({"key": {"name": "k"}, "expression": "'x'"})
    mixed = _reporter({"key": {"name": "k"}, "expression": "usage.prompt_tokens + 1"})  # double + int
    flag = _reporter({"key": {"name": "k"}, "expression": "usage.prompt_tokens > 1.0"})
    for r in (text, mixed, flag):
        assert r.evaluate({"prompt_tokens": 3}) == []


@pytest.mark.parametrize(
    ("attributes", "field", "reason"),
    [
        ([], "p.attributes", "at least one entry"),
        ([{"key": {"name": ""}, "expression": "1.0"}], "p.attributes[0].key.name", "cannot be empty"),
        ([{"key": {"name": "k"}, "expression": ""}], "p.attributes[0].expression", "cannot be empty"),
        (
            [
                {"key": {"name": "k"}, "expression": "1.0"},
                {"key": {"namespace": "envoy.lb", "name": "k"}, "expression": "2.0"},
            ],
            "p.attributes[1].key",
            "duplicate key",
        ),
        (
            [{"key": {"name": "k"}, "expression": "1.0", "extra": 1}],
            "p.attributes[0].extra",
            "unknown parameter",
        ),
    ],
)
def test_reporter_parameter_errors(attributes: list[object], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        decode_params(RequestAttributeReporterParams, {"attributes": attributes}, "p")
    assert e.value.field == field and reason in e.value.reason


@pytest.mark.parametrize(
    ("attribute", "field"),
    [
        ({"key": {"name": "k"}, "expression": "usage.prompt_tokens +"}, "attributes[0].expression"),
        ({"key": {"name": "k"}, "expression": "request.size"}, "attributes[0].expression"),
        ({"key": {"name": "k"}, "expression": "1.0", "condition": "has(usage."}, "attributes[0].condition"),
    ],
)
def test_reporter_bad_cel_is_a_config_error_naming_the_attribute(
    attribute: dict[str, object], field: str
) -> None:
    doc = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"name": "cost", "type": "request-attribute-reporter", "parameters": {"attributes": [attribute]}}
        ],
    }
    import yaml

    with pytest.raises(ConfigError) as e:
        load_config(yaml.safe_dump(doc))
    assert e.value.field == f"plugins[0].parameters.{field}"
    assert "failed to compile" in e.value.reason


def test_reporter_writes_metadata_only_at_the_end_of_the_response() -> None:
    r = _reporter(TOTAL)
    response = ResponseInfo(usage={"prompt_tokens": 2, "completion_tokens": 3})
    r.response_body(factories.request(), response, None, b"x")
    assert response.dynamic_metadata is None
    response.end_of_stream = True
    r.response_body(factories.request(), response, None, b"")
    assert response.dynamic_metadata == {"envoy.lb": {"x-gateway-inference-request-cost": 5.0}}


@pytest.fixture
async def reporting() -> AsyncIterator[Harness]:
    store = _store(1)
    h = await start(store, opts=StreamOptions(response_body=(_reporter(TOTAL),)))
    yield h
    await h.channel.close()
    await h.server.stop(0)


def _cost(resp: object) -> object:
    md = MessageToDict(resp.dynamic_metadata)  # type: ignore[attr-defined]
    return md.get("envoy.lb", {}).get("x-gateway-inference-request-cost")


async def test_reporter_metadata_rides_on_the_last_response_body_reply(reporting: Harness) -> None:
    body = b'{"id":"c","usage":{"prompt_tokens":11,"completion_tokens":31,"total_tokens":42}}'
    out = await reporting.exchange(
        [
            headers_msg({}),
            body_msg(CHAT, True),
            response_headers_msg({":status": "200", "content-type": "application/json"}),
            response_body_msg(body[:20], False),
            response_body_msg(body[20:], True),
        ],
        expect=5,  # each chunk answered as it comes (no model to undo: nothing holds the body)
    )
    last = out[-1]
    assert (
        last.HasField("response_body")
        and last.response_body.response.body_mutation.streamed_response.body == body[20:]
        and last.response_body.response.body_mutation.streamed_response.end_of_stream
    )
    assert _cost(last) == 42
    assert all(_cost(r) is None for r in out[:-1])


async def test_reporter_reads_streamed_usage_and_reports_on_the_trailers(reporting: Harness) -> None:
    sse = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":4,"com'
    )
    rest = b'pletion_tokens":6,"total_tokens":10}}\n\ndata: [DONE]\n\n'
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    out = await reporting.exchange(
        [
            headers_msg({}),
            body_msg(b'{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}', True),
            response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
            response_body_msg(sse, False),
            response_body_msg(rest, False),
            ep.ProcessingRequest(response_trailers=ep.HttpTrailers()),
        ],
        expect=6,
    )
    assert out[-1].HasField("response_trailers") and _cost(out[-1]) == 10
    assert _cost(out[-2]) is None


# --- disaggregatedset-rollout-screener ---------------------------------------------------------

REV, ROLE, SET = DEFAULT_REVISION_LABEL, DEFAULT_ROLE_LABEL, "disaggregatedset.x-k8s.io/name"


def _pods(shape: dict[str, dict[str, int]], *, other_set: bool = False) -> list[Endpoint]:
    """Endpoints per revision and role, e.g. ``{"A": {"prefill": 2, "decode": 9}}``."""
    out = []
    for rev, roles in shape.items():
        for role, n in roles.items():
            for i in range(n):
                labels = {REV: rev, ROLE: role, SET: "other" if other_set else "my-set", "slice": f"s{i % 2}"}
                out.append(factories.endpoint(f"{rev}-{role}-{i}", f"10.1.{len(out)}.1", labels=labels))
    return out


def _screener(
    eps: list[Endpoint], mode: str = "max-role", seed: int = 3, selectors: list[dict[str, str]] | None = None
) -> DisaggregatedSetRolloutScreener:
    raw = {
        "scope": {"labelSelector": f"{SET}=my-set"},
        "headerSelectors": selectors
        if selectors is not None
        else [
            {"name": "revision", "headerName": "X-Disagg-Revision", "labelKey": REV, "mode": "strict"},
            {"name": "slice", "headerName": "x-disagg-slice", "labelKey": "slice", "mode": "prefer"},
        ],
        "revisionGating": {"mode": mode, "requireRoles": {"values": ["prefill", "decode"]}},
    }
    params = decode_params(DisaggregatedSetRolloutScreenerParams, raw, "p")
    return DisaggregatedSetRolloutScreener(
        "rollout", params, factories.StubHandle(endpoints=eps), rng=random.Random(seed)
    )


@pytest.mark.parametrize(("mode", "share_a"), [("max-role", 0.9), ("sum", 11 / 13)])
def test_screener_weights_revisions_by_mode(mode: str, share_a: float) -> None:
    eps = _pods({"A": {"prefill": 2, "decode": 9}, "B": {"prefill": 1, "decode": 1}})
    s = _screener(eps, mode)
    assert s.shares() == pytest.approx({"A": share_a, "B": 1 - share_a})
    picks = collections.Counter()
    for _ in range(3000):
        kept = s.screen(factories.request(), list(eps))
        revisions = {e.metadata.labels[REV] for e in kept}
        assert len(revisions) == 1  # one revision per request, for every profile
        (rev,) = revisions
        assert len(kept) == sum(1 for e in eps if e.metadata.labels[REV] == rev)
        picks[rev] += 1
    assert picks["A"] / 3000 == pytest.approx(share_a, abs=0.03)


def test_screener_drops_revisions_missing_a_role_and_pods_out_of_scope() -> None:
    eps = [
        *_pods({"A": {"prefill": 1, "decode": 2}, "B": {"decode": 3}}),
        *_pods({"C": {"prefill": 5, "decode": 5}}, other_set=True),
    ]
    s = _screener(eps)
    assert s.shares() == {"A": 1.0}  # B has no prefill; C is another set (not counted)
    for _ in range(20):
        assert {e.metadata.labels[REV] for e in s.screen(factories.request(), list(eps))} == {"A"}
    assert (
        _screener(_pods({"B": {"decode": 3}})).screen(factories.request(), _pods({"B": {"decode": 3}})) == []
    )


def test_screener_counts_pods_not_ports_and_follows_the_pool() -> None:
    eps = _pods({"A": {"prefill": 1, "decode": 1}, "B": {"prefill": 1, "decode": 1}})
    ranks = [
        factories.endpoint(f"A-decode-0-rank-{i}", "10.9.0.1", 8000 + i, labels=eps[1].metadata.labels)
        for i in range(3)
    ]
    for r in ranks:
        r.metadata = dataclasses.replace(r.metadata, pod_name="A-decode-0")
    handle = factories.StubHandle(endpoints=[*eps, *ranks])
    s = _screener([])
    s._handle = handle
    assert s.shares() == pytest.approx({"A": 0.5, "B": 0.5})  # the 3 ranks are one pod (plus A-decode-0)
    handle.eps = eps[2:]  # revision A left the pool
    assert s.shares() == {"B": 1.0}


def test_screener_strict_header_pins_the_revision_without_a_draw() -> None:
    eps = _pods({"A": {"prefill": 2, "decode": 9}, "B": {"prefill": 1, "decode": 1}})
    s = _screener(eps, seed=0)
    for _ in range(50):
        kept = s.screen(factories.request(headers={"x-disagg-revision": "B"}), list(eps))
        assert {e.metadata.labels[REV] for e in kept} == {"B"} and len(kept) == 2
    before = _metric("llm_d_epp_disaggregatedset_strict_header_no_match_total", selector="revision")
    assert s.screen(factories.request(headers={"x-disagg-revision": "Z"}), list(eps)) == []
    assert (
        _metric("llm_d_epp_disaggregatedset_strict_header_no_match_total", selector="revision") == before + 1
    )


def test_screener_disabled_gating_keeps_selectors_and_stamps_headers() -> None:
    eps = _pods({"A": {"decode": 2}, "B": {"decode": 1}})
    s = _screener(eps, mode="disabled")
    assert s.screen(factories.request(), list(eps)) == eps  # no coverage check, no draw
    kept = s.screen(factories.request(headers={"x-disagg-revision": "A"}), list(eps))
    assert [e.metadata.name for e in kept] == ["A-decode-0", "A-decode-1"]
    response = ResponseInfo(headers={":status": "200"})
    s.response_header(factories.request(), response, eps[1])
    assert response.headers["x-disagg-revision"] == "A" and response.headers["x-disagg-slice"] == "s1"


async def test_screener_in_the_director_routes_one_revision_and_503_when_none_is_complete() -> None:
    store = EndpointStore()
    for e in _pods({"A": {"prefill": 1, "decode": 1}}):
        store.upsert(e.metadata)
    s = _screener([])
    s._handle = factories.StubHandle(endpoints=store.endpoints())
    director = _director(store, screeners=[s])
    r = await director.route(dict(PATH), CHAT, {})
    assert r.endpoints[0].metadata.labels[REV] == "A"
    s._handle = factories.StubHandle(endpoints=())  # no pod snapshot yet: fail closed
    with pytest.raises(InferenceError) as e:
        await director.route(dict(PATH), CHAT, {})
    assert e.value.code is ErrorCode.SERVICE_UNAVAILABLE


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        ({"revisionGating": {"mode": "disabled"}}, "p.scope.labelSelector", "is required"),
        (
            {"scope": {"labelSelector": "a in b"}, "revisionGating": {"mode": "disabled"}},
            "p.scope.labelSelector",
            "not a valid label selector",
        ),
        ({"scope": {"labelSelector": "a=b"}}, "p.revisionGating", "is required"),
        (
            {"scope": {"labelSelector": "a=b"}, "revisionGating": {"mode": "half"}},
            "p.revisionGating.mode",
            "sum|max-role|disabled",
        ),
        (
            {"scope": {"labelSelector": "a=b"}, "revisionGating": {"mode": "sum"}},
            "p.revisionGating.requireRoles",
            "is required",
        ),
        (
            {
                "scope": {"labelSelector": "a=b"},
                "revisionGating": {"mode": "sum", "requireRoles": {"values": ["p", "p"]}},
            },
            "p.revisionGating.requireRoles.values",
            "duplicate role",
        ),
        (
            {
                "scope": {"labelSelector": "a=b"},
                "revisionGating": {"mode": "disabled"},
                "headerSelectors": [{"name": "n", "headerName": "h", "labelKey": "k", "mode": "soft"}],
            },
            "p.headerSelectors[0].mode",
            "strict|prefer",
        ),
        (
            {
                "scope": {"labelSelector": "a=b"},
                "revisionGating": {"mode": "disabled"},
                "headerSelectors": [
                    {"name": "n", "headerName": "h", "labelKey": "k", "mode": "strict"},
                    {"name": "m", "headerName": "H", "labelKey": "k", "mode": "strict"},
                ],
            },
            "p.headerSelectors",
            "duplicate headerName",
        ),
    ],
)
def test_screener_parameter_errors(raw: dict[str, object], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        decode_params(DisaggregatedSetRolloutScreenerParams, raw, "p")
    assert e.value.field == field and reason in e.value.reason


def test_label_selector_syntax() -> None:
    reqs = parse_label_selector("a=b, c!=d,e in (x, y),f notin (z),g,!h")
    labels = {"a": "b", "e": "y", "g": "1"}
    assert all(r.matches(labels) for r in reqs)
    assert not all(r.matches({**labels, "h": "1"}) for r in reqs)
    assert not all(r.matches({**labels, "e": "q"}) for r in reqs)
    for bad in ("bad key=1", "a in x", "=b", "a=b,,"):
        with pytest.raises(ValueError):
            parse_label_selector(bad)


def _metric(name: str, **labels: str) -> float:
    text = promlite.exposition().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_usage_reader_merges_anthropic_events_and_ignores_bad_bodies() -> None:
    from epp.server.usage import UsageReader

    reader = UsageReader()
    reader.feed(b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":9,')
    reader.feed(b'"cache_read_input_tokens":4,"output_tokens":1}}}\n\n')
    reader.feed(b'data: {"type":"message_delta","usage":{"output_tokens":15}}\n\n')
    assert reader.usage == {
        "prompt_tokens": 9,
        "completion_tokens": 15,
        "total_tokens": 24,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    broken = UsageReader()
    broken.feed(b'{"usage": {"prompt_tokens": 3')
    assert broken.usage is None
    plain = UsageReader()
    plain.feed(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 99}}')
    assert plain.usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 99}
