"""Scorer catalog: each scorer against its documented algorithm, with hand-computed expectations."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import pytest

from epp.framework import (
    ApiKind,
    ConfigError,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    Plugin,
    ProfileRunResult,
    ResponseInfo,
    SchedulingResult,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.params import decode_params
from epp.framework.registry import lookup
from epp.plugins.scorers.context_length_aware import ContextLengthAware
from epp.plugins.scorers.load_aware import LoadAwareScorer
from epp.plugins.scorers.lora_affinity import LoraAffinityScorer
from epp.plugins.scorers.no_hit_lru import NoHitLRUScorer
from epp.plugins.scorers.running_requests_size import RunningRequestsSizeScorer
from epp.plugins.scorers.session_affinity import SessionAffinityScorer
from tests.unit.factories import endpoint, known_metrics, request

CTX_LABEL = "llm-d.ai/context-length-range"


def ep(
    name: str,
    metrics: Metrics | None = None,
    labels: Mapping[str, str] | None = None,
    namespace: str = "default",
) -> Endpoint:
    """An endpoint whose ``metrics`` (default ``Metrics()``) were scraped and are known."""
    return endpoint(name, namespace=namespace, labels=labels, metrics=known_metrics(metrics))


def build(cls: type[Plugin], raw: dict[str, Any] | None = None) -> Any:
    """Instantiate like the loader does: decode the YAML parameters, then construct."""
    return cls("s", decode_params(cls.Params, raw, "plugins[0].parameters"))


# --- running-requests-size-scorer -------------------------------------------------------------


def test_running_requests_size_min_max() -> None:
    eps = [ep(f"e{i}", Metrics(running_requests_size=r)) for i, r in enumerate([2, 4, 10])]
    # max 10, min 2: (10-2)/8, (10-4)/8, (10-10)/8
    assert build(RunningRequestsSizeScorer).score(CycleState(), request(), eps) == [1.0, 0.75, 0.0]


def test_running_requests_size_all_equal_scores_one() -> None:
    eps = [ep(f"e{i}", Metrics(running_requests_size=7, waiting_queue_size=i)) for i in range(3)]
    assert build(RunningRequestsSizeScorer).score(CycleState(), request(), eps) == [1.0, 1.0, 1.0]
    assert lookup("running-requests-size-scorer") is RunningRequestsSizeScorer


# --- load-aware-scorer ------------------------------------------------------------------------


def _queues(*qs: int) -> list[Endpoint]:
    return [ep(f"e{i}", Metrics(waiting_queue_size=q)) for i, q in enumerate(qs)]


def test_load_aware_with_threshold() -> None:
    s = build(LoadAwareScorer, {"threshold": 10})
    # 0 -> 0.5; 5 -> 0.5*(1-5/10)=0.25; 10 -> 0; 20 caps at 10 -> 0; 1 -> 0.5*0.9=0.45
    assert s.score(CycleState(), request(), _queues(0, 5, 10, 20, 1)) == pytest.approx(
        [0.5, 0.25, 0.0, 0.0, 0.45]
    )


def test_load_aware_default_and_non_positive_threshold_is_128() -> None:
    eps = _queues(0, 64, 128, 32)
    expected = [0.5, 0.25, 0.0, 0.375]  # 0.5*(1-64/128), 0.5*(1-32/128)
    for raw in (None, {"threshold": 0}, {"threshold": -3}):
        assert build(LoadAwareScorer, raw).score(CycleState(), request(), eps) == pytest.approx(expected)


def test_load_aware_threshold_must_be_an_integer() -> None:
    with pytest.raises(ConfigError) as e:
        build(LoadAwareScorer, {"threshold": "high"})
    assert e.value.field == "plugins[0].parameters.threshold"


# --- lora-affinity-scorer ---------------------------------------------------------------------


def test_lora_affinity_checks_active_then_capacity_then_waiting() -> None:
    eps = [
        ep("active", Metrics(active_models={"lora-a": 1, "x": 1}, max_active_models=2)),
        ep("room", Metrics(active_models={"x": 1}, max_active_models=4)),
        # waiting, but with room: capacity is checked first -> 0.8
        ep("waiting-room", Metrics(waiting_models={"lora-a": 1}, max_active_models=4)),
        ep(
            "waiting-full", Metrics(active_models={"x": 1}, waiting_models={"lora-a": 1}, max_active_models=2)
        ),
        ep("full", Metrics(active_models={"x": 1, "y": 1}, max_active_models=2)),
        ep("no-lora", Metrics()),  # max 0: no capacity
    ]
    s = build(LoraAffinityScorer)
    assert s.score(CycleState(), request(model="lora-a"), eps) == [1.0, 0.8, 0.8, 0.6, 0.0, 0.0]
    assert s.category == "Affinity"


# --- session-affinity-scorer ------------------------------------------------------------------


def test_session_affinity_scores_the_encoded_endpoint() -> None:
    eps = [
        ep("pod-a-rank-0", namespace="ns"),
        ep("pod-b-rank-0", namespace="ns"),
        ep("pod-b-rank-0", namespace="other"),
    ]
    token = base64.b64encode(b"ns/pod-b-rank-0").decode()
    s = build(SessionAffinityScorer)
    assert s.score(CycleState(), request(headers={"x-session-token": token}), eps) == [0.0, 1.0, 0.0]


def test_session_affinity_missing_unknown_or_bad_token_scores_zero() -> None:
    eps = [ep("a", namespace="ns"), ep("b", namespace="ns")]
    s = build(SessionAffinityScorer)
    for headers in (
        {},
        {"x-session-token": ""},
        {"x-session-token": base64.b64encode(b"ns/zzz").decode()},
        {"x-session-token": "!!not-base64!!"},
        {"x-session-token": "bnMvYQ"},  # "ns/a" without padding: not valid standard base64
    ):
        assert s.score(CycleState(), request(headers=headers), eps) == [0.0, 0.0]


def test_session_affinity_sets_token_on_response_headers() -> None:
    s = build(SessionAffinityScorer)
    target = ep("pod-a-rank-1", namespace="team")
    response = ResponseInfo(headers={":status": "200"})
    s.response_header(request(), response, target)
    assert response.headers["x-session-token"] == base64.b64encode(b"team/pod-a-rank-1").decode()
    # the header round-trips into a score of 1 for that endpoint
    next_req = request(headers={"x-session-token": response.headers["x-session-token"]})
    assert s.score(CycleState(), next_req, [ep("other", namespace="team"), target]) == [0.0, 1.0]

    untouched = ResponseInfo(headers={":status": "200"})
    s.response_header(request(), untouched, None)
    assert untouched.headers == {":status": "200"}


# --- no-hit-lru-scorer ------------------------------------------------------------------------


def _result(primary: Endpoint, prefill: Endpoint | None = None) -> SchedulingResult:
    results: dict[str, ProfileRunResult | None] = {"decode": ProfileRunResult([primary])}
    if prefill is not None:
        results["prefill"] = ProfileRunResult([prefill])
    return SchedulingResult(results, "decode")


def _cycle(infos: dict[Endpoint, PrefixCacheMatchInfo] | None = None) -> CycleState:
    cycle = CycleState()
    if infos is not None:
        cycle[PREFIX_CACHE_MATCH_INFO_KEY] = infos
    return cycle


def _schedule(s: NoHitLRUScorer, eps: list[Endpoint], target: Endpoint) -> list[float]:
    """Score a cold request, then run PreRequest with ``target`` chosen; return the scores."""
    cycle = _cycle()
    scores = list(s.score(cycle, request(), eps))
    s.pre_request(cycle, request(), _result(target))
    return scores


def test_no_hit_lru_declares_its_input() -> None:
    assert PREFIX_CACHE_MATCH_INFO_KEY in NoHitLRUScorer.consumes
    assert NoHitLRUScorer.category == "Distribution"
    assert lookup("no-hit-lru-scorer") is NoHitLRUScorer


def test_no_hit_lru_warm_request_is_neutral() -> None:
    a, b, c = ep("a"), ep("b"), ep("c")
    s = build(NoHitLRUScorer)
    cycle = _cycle({a: PrefixCacheMatchInfo(0, 4, 16), b: PrefixCacheMatchInfo(2, 4, 16)})
    assert s.score(cycle, request(), [a, b, c]) == [0.5, 0.5, 0.5]
    s.pre_request(cycle, request(), _result(a))
    assert s.lru_keys() == []  # warm requests do not touch the LRU


def test_no_hit_lru_hits_only_count_on_candidates() -> None:
    a, b, elsewhere = ep("a"), ep("b"), ep("elsewhere")
    s = build(NoHitLRUScorer)
    cycle = _cycle({a: PrefixCacheMatchInfo(0, 4, 16), elsewhere: PrefixCacheMatchInfo(3, 4, 16)})
    assert s.score(cycle, request(), [a, b]) == [1.0, 0.0]  # cold: never used, 1 - i/(2-1)


def test_no_hit_lru_cold_single_candidate_scores_one() -> None:
    assert build(NoHitLRUScorer).score(_cycle(), request(), [ep("a")]) == [1.0]


def test_no_hit_lru_cold_ranks_never_used_then_oldest() -> None:
    a, b, c = ep("a"), ep("b"), ep("c")
    s = build(NoHitLRUScorer)
    # fresh LRU: never-used in candidate order 1 - i/2
    assert _schedule(s, [a, b, c], target=b) == [1.0, 0.5, 0.0]
    assert s.lru_keys() == ["default/b"]
    # never used: a (i=0) -> 1, c (i=1) -> 0.5; b: rank 2 + 0 = 2 -> 1 - 2/2 = 0
    assert _schedule(s, [a, b, c], target=a) == [1.0, 0.0, 0.5]
    assert s.lru_keys() == ["default/b", "default/a"]
    # never used: c -> 1; b: rank 1 + 0 -> 0.5; a: rank 1 + 1 -> 0
    assert _schedule(s, [a, b, c], target=c) == [0.0, 0.5, 1.0]
    assert s.lru_keys() == ["default/b", "default/a", "default/c"]
    # all used: b oldest -> 1 - 0/2, a -> 1 - 1/2, c -> 0
    assert _schedule(s, [a, b, c], target=b) == [0.5, 1.0, 0.0]
    assert s.lru_keys() == ["default/a", "default/c", "default/b"]


def test_no_hit_lru_positions_are_absolute_in_the_lru() -> None:
    s = build(NoHitLRUScorer)
    x, y, z, a, b = ep("x"), ep("y"), ep("z"), ep("a"), ep("b")
    for target in (x, y, z, a):
        _schedule(s, [target], target)
    # candidates a (LRU position 3) and b (never used), N = 2: b -> 1; a -> max(0, 1 - (1 + 3)/1) = 0
    assert s.score(_cycle(), request(), [a, b]) == [0.0, 1.0]


def test_no_hit_lru_pre_request_moves_primary_and_prefill_targets() -> None:
    d, p, other = ep("d"), ep("p"), ep("other")
    s = build(NoHitLRUScorer)
    cycle = _cycle()
    s.score(cycle, request(), [d, p, other])
    s.pre_request(cycle, request(), _result(d, prefill=p))
    assert s.lru_keys() == ["default/d", "default/p"]


def test_no_hit_lru_pre_request_without_score_or_target_is_a_no_op() -> None:
    a = ep("a")
    s = build(NoHitLRUScorer)
    s.pre_request(_cycle(), request(), _result(a))  # no cold flag recorded
    assert s.lru_keys() == []
    cycle = _cycle()
    s.score(cycle, request(), [a])
    s.pre_request(cycle, request(), SchedulingResult({"decode": None}, "decode"))
    assert s.lru_keys() == []
    # the flag was consumed by the first PreRequest: a second one does nothing
    s.pre_request(cycle, request(), _result(a))
    assert s.lru_keys() == []


def test_no_hit_lru_evicts_beyond_lru_size() -> None:
    s = build(NoHitLRUScorer, {"lruSize": 2})
    a, b, c = ep("a"), ep("b"), ep("c")
    for target in (a, b, c):
        _schedule(s, [a, b, c], target)
    assert s.lru_keys() == ["default/b", "default/c"]


def test_no_hit_lru_parameters() -> None:
    assert build(NoHitLRUScorer, {"lruSize": 0}).params.effective_lru_size == 1024
    assert build(NoHitLRUScorer, {"lruSize": -1}).params.effective_lru_size == 1024
    p = build(NoHitLRUScorer, {"prefixPluginType": "prefix-cache-scorer", "prefixPluginName": "p"}).params
    assert p.effective_lru_size == 1024
    with pytest.raises(ConfigError) as e:
        build(NoHitLRUScorer, {"lruSize": "big"})
    assert e.value.field == "plugins[0].parameters.lruSize"


# --- context-length-aware ---------------------------------------------------------------------


def _ctx_eps(*labels: str | None) -> list[Endpoint]:
    return [ep(f"e{i}", labels={CTX_LABEL: v} if v is not None else {}) for i, v in enumerate(labels)]


def _prompt(chars: int) -> LLMRequest:
    return request(payload={"model": "m", "prompt": "x" * chars})


def test_context_length_scores() -> None:
    s = build(ContextLengthAware)
    eps = _ctx_eps("0-1000", "100-100", "200-300", "0-50", None, "abc", "10-5", "1-2-3", " 0 - 2048 ", "")
    # 400 chars -> L = 100
    expected = [
        # in range, w=1000: 0.3 + 0.7*(0.7/1.1 + 0.3*900/1000) = 0.3 + 0.7*0.906363.. = 0.934454..
        0.9344545454545454,
        1.0,  # w = 0
        0.3 / 1.1,  # below min by 100
        0.3 / 1.05,  # above max by 50
        0.5,  # unlabelled
        0.0,  # unparsable
        0.0,  # min > max
        0.0,  # three parts
        # in range, w=2048: 0.3 + 0.7*(0.7/1.2048 + 0.3*1948/2048)
        0.3 + 0.7 * (0.7 / 1.2048 + 0.3 * 1948 / 2048),
        0.0,  # empty value
    ]
    assert s.score(CycleState(), _prompt(400), eps) == pytest.approx(expected)
    assert s.category == "Affinity"


def test_context_length_in_range_always_beats_out_of_range() -> None:
    s = build(ContextLengthAware)
    # L = 100000 at the far end of a very wide range vs just 1 token outside a range
    scores = s.score(CycleState(), _prompt(400_000), _ctx_eps("0-100000", "0-99999"))
    # in: 0.3 + 0.7*(0.7/11 + 0) = 0.3445..; out: 0.3/(1 + 1/1000) = 0.2997..
    assert scores == pytest.approx([0.3 + 0.7 * 0.7 / 11, 0.3 / 1.001])
    assert scores[0] > scores[1]


def test_context_length_request_length_estimates() -> None:
    s = build(ContextLengthAware)
    eps = _ctx_eps("20-20")  # scores 1.0 only when L == 20
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 40}],
    }
    assert s.score(CycleState(), request(chat, api=ApiKind.CHAT_COMPLETIONS), eps) == [1.0]  # 80 chars
    blocks = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a" * 39},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "b" * 39},
                ],
            }
        ],
    }
    # plain text = each text block plus a space: 40 + 40 = 80 chars
    assert s.score(CycleState(), request(blocks, api=ApiKind.CHAT_COMPLETIONS), eps) == [1.0]
    assert s.score(CycleState(), request(payload={"model": "m", "prompt": [7] * 20}), eps) == [
        1.0
    ]  # token ids
    assert s.score(CycleState(), request(payload={"model": "m", "prompt": "é" * 40}), eps) == [
        1.0
    ]  # 80 bytes
    assert s.score(CycleState(), _prompt(83), eps) == [1.0]  # int(20.75)
    assert s.score(CycleState(), _prompt(84), eps) != [1.0]


def test_context_length_filter_only_when_enabled() -> None:
    eps = _ctx_eps("0-1000", "2000-4000", None, "bogus")
    off = build(ContextLengthAware)
    assert off.filter(CycleState(), _prompt(400), eps) == eps
    on = build(ContextLengthAware, {"enableFiltering": True})
    assert [e.metadata.name for e in on.filter(CycleState(), _prompt(400), eps)] == ["e0", "e2"]
    assert [e.metadata.name for e in on.filter(CycleState(), _prompt(12_000), eps)] == ["e1", "e2"]


def test_context_length_custom_label_and_validation() -> None:
    s = build(ContextLengthAware, {"label": "ctx"})
    eps = [ep("a", labels={"ctx": "0-10"}), ep("b", labels={CTX_LABEL: "0-10"})]
    assert s.score(CycleState(), _prompt(0), eps) == pytest.approx([0.3 + 0.7 * (0.7 / 1.001 + 0.3), 0.5])
    with pytest.raises(ConfigError) as e:
        build(ContextLengthAware, {"label": ""})
    assert e.value.field == "plugins[0].parameters.label"
    assert "'label' must be specified" in e.value.reason
