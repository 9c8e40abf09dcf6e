"""Disaggregated serving: deciders, the disagg / pd / data-parallel handlers and the P/D headers.

Profiles are built directly from plugin classes and run through ``Scheduler.schedule``; role filters
are test-local (the reference's ``llm-d.ai/role`` sets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from epp.framework import (
    ApiKind,
    ConfigError,
    CycleState,
    Endpoint,
    Filter,
    LLMRequest,
    Plugin,
    ProfileRunResult,
    SchedulingError,
    SchedulingOutcome,
    SchedulingResult,
    registry,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo
from epp.framework.params import decode_params, encode_params
from epp.plugins.deciders import Decider
from epp.plugins.deciders.always_disagg import AlwaysDisaggDecider
from epp.plugins.deciders.multimodal import AlwaysDisaggMultimodalDecider
from epp.plugins.deciders.prefix_based import (
    PrefixBasedPDDecider,
    PrefixBasedPDDeciderParams,
    estimate_input_tokens,
)
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.profile_handlers.data_parallel import (
    DataParallelParams,
    DataParallelProfileHandler,
    PortRewrittenEndpoint,
)
from epp.plugins.profile_handlers.disagg import (
    DisaggDeciders,
    DisaggParams,
    DisaggProfileHandler,
    DisaggProfiles,
)
from epp.plugins.profile_handlers.disagg_headers import DisaggHeadersHandler, DisaggHeadersParams
from epp.plugins.profile_handlers.pd_legacy import PdParams, PdProfileHandler
from epp.plugins.scorers.queue import QueueScorer
from epp.scheduling import Scheduler, SchedulerProfile, WeightedScorer
from tests.unit import factories
from tests.unit.factories import StubHandle, chat, known_metrics

ROLE = "llm-d.ai/role"
PREFILL_HEADER = "x-prefiller-host-port"
ENCODERS_HEADER = "x-encoder-hosts-ports"
DP_HEADER = "x-data-parallel-host-port"
DISAGG_METRIC = "llm_d_inference_scheduler_disagg_decision_total"
PD_METRIC = "llm_d_inference_scheduler_pd_decision_total"

DECODE_ROLES = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})
PREFILL_ROLES = frozenset({"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"})
ENCODE_ROLES = frozenset({"encode", "encode-prefill", "encode-prefill-decode"})
ALL_ROLES = sorted(DECODE_ROLES | PREFILL_ROLES | ENCODE_ROLES)
# profile name -> (accepted roles, unlabelled endpoints kept)
STAGE_ROLES: dict[str, tuple[frozenset[str], bool]] = {
    "decode": (DECODE_ROLES, True),
    "prefill": (PREFILL_ROLES, False),
    "encode": (ENCODE_ROLES, False),
}


# --- helpers -----------------------------------------------------------------------------------


class _RoleFilter(Filter):
    type_name = "test-role-filter"

    def __init__(self, roles: frozenset[str], keep_unlabelled: bool) -> None:
        super().__init__("role", None)
        self.roles = roles
        self.keep_unlabelled = keep_unlabelled

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return [e for e in endpoints if _passes(e, self.roles, self.keep_unlabelled)]


def _passes(e: Endpoint, roles: frozenset[str], keep_unlabelled: bool) -> bool:
    role = e.metadata.labels.get(ROLE)
    return keep_unlabelled if role is None else role in roles


class _RejectAll(Filter):
    type_name = "test-reject-all"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return []


@dataclass(slots=True)
class _Tracked(SchedulerProfile):
    """A profile that records each run and whether it picked something."""

    runs: list[bool] = field(default_factory=list)

    def run(self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint]) -> ProfileRunResult:
        try:
            result = SchedulerProfile.run(self, cycle, request, candidates)
        except SchedulingError:
            self.runs.append(False)
            raise
        self.runs.append(True)
        return result


def stage(name: str, fail: bool = False, k: int = 1) -> _Tracked:
    roles, keep = STAGE_ROLES[name]
    filters: list[Filter] = [_RoleFilter(roles, keep)]
    if fail:
        filters.append(_RejectAll("reject", None))
    return _Tracked(
        name,
        filters=filters,
        scorers=[WeightedScorer(QueueScorer("queue", None))],
        picker=MaxScorePicker("picker", PickerParams(max_num_of_endpoints=k)),
    )


def ep(i: int, role: str | None, queue: int = 0, port: int = 8000, address: str = "") -> Endpoint:
    labels = {ROLE: role} if role is not None else {}
    metrics = known_metrics(waiting_queue_size=queue)
    return factories.endpoint(
        f"pod{i}-rank-0", address or f"10.0.0.{i}", port, labels=labels, metrics=metrics
    )


def completions(prompt: Any = "hello", headers: dict[str, str] | None = None, model: str = "m") -> LLMRequest:
    return factories.completions(prompt, headers=headers, model=model)


class _Fixed(Decider):
    type_name = "test-fixed-decider"

    def __init__(self, name: str, answer: bool) -> None:
        super().__init__(name, None)
        self.answer = answer
        self.calls = 0

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
        self.calls += 1
        return self.answer


class _Capturing(DisaggProfileHandler):
    """The real handler, remembering the results map it was given."""

    seen: dict[str, ProfileRunResult | None]

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        self.seen = dict(results)
        return super().process_results(cycle, request, results)


def disagg(*deciders: Plugin, params: DisaggParams | None = None) -> _Capturing:
    return _Capturing("disagg-profile-handler", params or DisaggParams(), StubHandle(*deciders))


def nested(prefill: str = "", encode: str = "") -> DisaggParams:
    return DisaggParams(deciders=DisaggDeciders(prefill=prefill, encode=encode))


def count(metric: str, decision: str, model: str = "m") -> float:
    return REGISTRY.get_sample_value(metric, {"model_name": model, "decision_type": decision}) or 0.0


def run(
    handler: Any, profiles: Sequence[SchedulerProfile], request: LLMRequest, pool: list[Endpoint]
) -> SchedulingOutcome:
    return Scheduler(handler, {p.name: p for p in profiles}).schedule(CycleState(), request, pool)


def targets(result: SchedulingResult, name: str) -> list[Endpoint]:
    r = result.profile_results[name]
    assert r is not None
    return r.target_endpoints


# --- disagg-profile-handler: P/D ---------------------------------------------------------------


def test_decode_and_prefill_ok_decode_is_primary_and_prefill_header_is_set() -> None:
    pool = [
        ep(0, "decode", queue=3),
        ep(1, "decode", queue=0),
        ep(2, "prefill", queue=0),
        ep(3, "prefill", 9),
    ]
    handler = disagg(AlwaysDisaggDecider("always", None), params=nested(prefill="always"))
    before = (count(DISAGG_METRIC, "prefill-decode"), count(PD_METRIC, "prefill-decode"))
    req = completions()

    result, err = run(handler, [stage("decode"), stage("prefill")], req, pool)

    assert err is None and result is not None
    assert result.primary_profile_name == "decode"
    assert targets(result, "decode") == [pool[1]]  # shortest queue among decode-role endpoints
    assert targets(result, "prefill") == [pool[2]]
    handler.pre_request(CycleState(), req, result)
    assert req.headers[PREFILL_HEADER] == "10.0.0.2:8000"
    assert ENCODERS_HEADER not in req.headers
    assert count(DISAGG_METRIC, "prefill-decode") == before[0] + 1
    assert count(PD_METRIC, "prefill-decode") == before[1] + 1


def test_prefill_profile_fails_request_is_served_decode_only() -> None:
    pool = [ep(0, "decode"), ep(1, "decode", queue=4)]  # no prefill-capable endpoint at all
    handler = disagg(AlwaysDisaggDecider("always", None), params=nested(prefill="always"))
    decode, prefill = stage("decode"), stage("prefill")
    before = (count(DISAGG_METRIC, "decode-only"), count(PD_METRIC, "decode-only"))
    req = completions(headers={PREFILL_HEADER: "6.6.6.6:1"})

    result, err = run(handler, [decode, prefill], req, pool)

    assert err is None and result is not None
    assert prefill.runs == [False]  # it ran and failed ...
    assert "prefill" in handler.seen and handler.seen["prefill"] is None  # ... an explicit None entry
    assert set(result.profile_results) == {"decode"}
    assert targets(result, "decode") == [pool[0]]
    handler.pre_request(CycleState(), req, result)
    assert PREFILL_HEADER not in req.headers  # the client's copy is gone too
    assert count(DISAGG_METRIC, "decode-only") == before[0] + 1
    assert count(PD_METRIC, "decode-only") == before[1] + 1


def test_decider_says_no_prefill_is_skipped_without_running() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill")]
    no = _Fixed("no", False)
    handler = disagg(no, params=nested(prefill="no"))
    prefill = stage("prefill")
    before = count(DISAGG_METRIC, "decode-only")
    req = completions()

    result, err = run(handler, [stage("decode"), prefill], req, pool)

    assert err is None and result is not None
    assert prefill.runs == []
    assert no.calls == 1  # asked once, the skip is remembered as an explicit None
    assert handler.seen == {"decode": ProfileRunResult([pool[0]]), "prefill": None}
    assert "prefill" not in result.profile_results
    handler.pre_request(CycleState(), req, result)
    assert PREFILL_HEADER not in req.headers
    assert count(DISAGG_METRIC, "decode-only") == before + 1


def test_no_prefill_decider_means_decode_only_even_with_a_prefill_profile() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill")]
    handler = disagg()
    prefill = stage("prefill")
    result, err = run(handler, [stage("decode"), prefill], completions(), pool)
    assert err is None and result is not None
    assert prefill.runs == [] and set(result.profile_results) == {"decode"}


def test_decode_fails_the_request_fails_and_nothing_else_runs() -> None:
    pool = [ep(0, "prefill"), ep(1, "encode")]  # nothing can decode
    decider = _Fixed("yes", True)
    handler = disagg(decider, params=nested(prefill="yes"))
    prefill = stage("prefill")
    before = {d: count(DISAGG_METRIC, d) for d in ("decode-only", "prefill-decode")}

    result, err = run(handler, [stage("decode"), prefill], completions(), pool)

    assert result is None
    assert isinstance(err, SchedulingError)
    assert str(err) == "failed to find available decode workers"
    assert prefill.runs == [] and decider.calls == 0
    assert handler.seen == {"decode": None}
    assert {d: count(DISAGG_METRIC, d) for d in before} == before  # no decision is recorded


def test_missing_decode_profile_runs_nothing_and_is_rejected_at_load() -> None:
    handler = disagg(AlwaysDisaggDecider("always", None), params=nested(prefill="always"))
    result, err = run(handler, [stage("prefill")], completions(), [ep(0, "prefill")])
    assert result is None and err is not None
    assert "failed to run any scheduler profile" in str(err)
    reason = handler.validate_profiles(["prefill"])
    assert reason is not None and "decode" in reason
    assert handler.validate_profiles(["prefill", "decode"]) is None


def test_client_sent_disagg_headers_are_replaced_or_removed() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill")]
    handler = disagg(AlwaysDisaggDecider("always", None), params=nested(prefill="always"))
    spoofed = {PREFILL_HEADER: "6.6.6.6:1", ENCODERS_HEADER: "6.6.6.6:2,6.6.6.6:3"}

    req = completions(headers=spoofed)
    result, _ = run(handler, [stage("decode"), stage("prefill")], req, pool)
    assert result is not None
    handler.pre_request(CycleState(), req, result)
    assert req.headers[PREFILL_HEADER] == "10.0.0.1:8000"
    assert ENCODERS_HEADER not in req.headers  # no encode stage: the spoofed value is deleted

    req = completions(headers=spoofed)
    result, _ = run(handler, [stage("decode"), stage("prefill", fail=True)], req, pool)
    assert result is not None
    handler.pre_request(CycleState(), req, result)
    assert PREFILL_HEADER not in req.headers and ENCODERS_HEADER not in req.headers


def test_prefill_header_brackets_ipv6_addresses() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill", address="fd00::7", port=8200)]
    handler = disagg(AlwaysDisaggDecider("always", None), params=nested(prefill="always"))
    req = completions()
    result, _ = run(handler, [stage("decode"), stage("prefill")], req, pool)
    assert result is not None
    handler.pre_request(CycleState(), req, result)
    assert req.headers[PREFILL_HEADER] == "[fd00::7]:8200"


def test_custom_profile_names_and_flat_parameters() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill")]
    params = decode_params(
        DisaggParams, {"decodeProfile": "d", "prefillProfile": "p", "deciderPluginName": "always"}, "x"
    )
    assert params.profiles == DisaggProfiles(decode="d", prefill="p", encode="encode")
    handler = disagg(AlwaysDisaggDecider("always", None), params=params)
    d, p = stage("decode"), stage("prefill")
    d.name, p.name = "d", "p"
    req = completions()
    result, err = run(handler, [d, p], req, pool)
    assert err is None and result is not None
    assert result.primary_profile_name == "d"
    assert targets(result, "p") == [pool[1]]
    handler.pre_request(CycleState(), req, result)
    assert req.headers[PREFILL_HEADER] == "10.0.0.1:8000"


# --- disagg-profile-handler: encode stage ------------------------------------------------------

IMAGE_MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "http://x/cat.png"}},
        ],
    }
]


def test_encode_stage_runs_before_prefill_and_lists_every_encoder() -> None:
    pool = [
        ep(0, "decode"),
        ep(1, "prefill"),
        ep(2, "encode", queue=1),
        ep(3, "encode", queue=0),
        ep(4, "encode", queue=7),
    ]
    handler = disagg(
        AlwaysDisaggMultimodalDecider("mm", None),
        AlwaysDisaggDecider("always", None),
        params=nested(prefill="always", encode="mm"),
    )
    order: list[str] = []
    encode, prefill = stage("encode", k=2), stage("prefill")
    for prof in (encode, prefill):
        original = prof.runs
        prof.runs = _OrderLog(prof.name, order, original)
    before = count(DISAGG_METRIC, "encode-prefill-decode")
    req = chat(IMAGE_MESSAGES)

    result, err = run(handler, [prefill, stage("decode"), encode], req, pool)

    assert err is None and result is not None
    assert order == ["encode", "prefill"]
    assert targets(result, "encode") == [pool[3], pool[2]]  # best first
    handler.pre_request(CycleState(), req, result)
    assert req.headers[ENCODERS_HEADER] == "10.0.0.3:8000,10.0.0.2:8000"
    assert req.headers[PREFILL_HEADER] == "10.0.0.1:8000"
    assert count(DISAGG_METRIC, "encode-prefill-decode") == before + 1


class _OrderLog(list[bool]):
    def __init__(self, name: str, order: list[str], initial: list[bool]) -> None:
        super().__init__(initial)
        self.name = name
        self.order = order

    def append(self, ok: bool) -> None:
        self.order.append(self.name)
        super().append(ok)


def test_text_only_request_skips_encode_and_records_encode_decode_only_with_media() -> None:
    pool = [ep(0, "decode"), ep(2, "encode")]
    handler = disagg(AlwaysDisaggMultimodalDecider("mm", None), params=nested(encode="mm"))
    encode = stage("encode")

    req = chat([{"role": "user", "content": "just text"}])
    result, err = run(handler, [stage("decode"), encode], req, pool)
    assert err is None and result is not None
    assert encode.runs == [] and handler.seen["encode"] is None
    handler.pre_request(CycleState(), req, result)
    assert ENCODERS_HEADER not in req.headers

    before = count(DISAGG_METRIC, "encode-decode")
    req = chat(IMAGE_MESSAGES)
    result, err = run(handler, [stage("decode"), stage("encode")], req, pool)
    assert result is not None
    handler.pre_request(CycleState(), req, result)
    assert req.headers[ENCODERS_HEADER] == "10.0.0.2:8000"
    assert count(DISAGG_METRIC, "encode-decode") == before + 1


def test_failed_encode_keeps_prefill_and_decode() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill")]  # no encoder
    handler = disagg(AlwaysDisaggDecider("always", None), params=nested(prefill="always", encode="always"))
    before = count(DISAGG_METRIC, "prefill-decode")
    result, err = run(handler, [stage("decode"), stage("prefill"), stage("encode")], completions(), pool)
    assert err is None and result is not None
    assert handler.seen["encode"] is None
    assert set(result.profile_results) == {"decode", "prefill"}
    assert count(DISAGG_METRIC, "prefill-decode") == before + 1


def test_empty_model_name_is_recorded_as_unknown() -> None:
    handler = disagg()
    before = count(DISAGG_METRIC, "decode-only", model="unknown")
    result, _ = run(handler, [stage("decode")], completions(model=""), [ep(0, None)])
    assert result is not None
    assert count(DISAGG_METRIC, "decode-only", model="unknown") == before + 1


# --- deciders ----------------------------------------------------------------------------------


def prefix_decider(threshold: int) -> PrefixBasedPDDecider:
    return PrefixBasedPDDecider("prefix", PrefixBasedPDDeciderParams(non_cached_tokens=threshold))


def with_match(endpoint: Endpoint, match_blocks: int, block_size: int) -> CycleState:
    cycle = CycleState()
    cycle[PREFIX_CACHE_MATCH_INFO_KEY] = {endpoint: PrefixCacheMatchInfo(match_blocks, 64, block_size)}
    return cycle


@pytest.mark.parametrize(
    ("chars", "match_blocks", "block_size", "expected"),
    [
        (400, 0, 16, True),  # 100 tokens, nothing cached: 100 >= 50
        (400, 2, 16, True),  # 100 - 32 = 68 >= 50
        (400, 4, 16, False),  # 100 - 64 = 36 < 50
        (400, 5, 10, True),  # 100 - 50 = 50 >= 50 (boundary disaggregates)
        (400, 6, 10, False),  # 100 - 60 = 40 < 50
        (200, 0, 16, True),  # 50 tokens: at the threshold
        (199, 0, 16, False),  # 49 tokens (199 // 4): below the threshold whatever the cache
        (196, 0, 16, False),
    ],
)
def test_prefix_decider_thresholds(chars: int, match_blocks: int, block_size: int, expected: bool) -> None:
    decode = ep(0, "decode")
    cycle = with_match(decode, match_blocks, block_size)
    assert prefix_decider(50).disaggregate(cycle, completions("a" * chars), decode) is expected


def test_prefix_decider_zero_disables_and_missing_match_info_declines() -> None:
    decode, other = ep(0, "decode"), ep(1, "decode")
    long = completions("a" * 4000)
    assert prefix_decider(0).disaggregate(with_match(decode, 0, 16), long, decode) is False
    assert prefix_decider(10).disaggregate(CycleState(), long, decode) is False  # no producer output
    assert prefix_decider(10).disaggregate(with_match(other, 0, 16), long, decode) is False  # not ours
    wrong = CycleState({PREFIX_CACHE_MATCH_INFO_KEY: {decode: 0.5}})
    assert prefix_decider(10).disaggregate(wrong, long, decode) is False
    assert prefix_decider(10).disaggregate(with_match(decode, 0, 16), long, decode) is True


def test_prefix_decider_rejects_negative_threshold() -> None:
    with pytest.raises(ConfigError) as info:
        decode_params(PrefixBasedPDDeciderParams, {"nonCachedTokens": -1}, "plugins[0].parameters")
    assert info.value.field == "plugins[0].parameters.nonCachedTokens"
    assert "cannot be negative" in info.value.reason


def test_prefix_decider_consumes_the_prefix_match_key() -> None:
    assert PREFIX_CACHE_MATCH_INFO_KEY in PrefixBasedPDDecider.consumes
    assert PREFIX_CACHE_MATCH_INFO_KEY in DisaggProfileHandler.consumes


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("a" * 41, 10),
        ("é" * 8, 4),  # 16 UTF-8 bytes
        (["abcd", "efgh"], 2),  # D17: "abcd efgh" is 9 bytes -> 2 (the reference: 0)
        ([1, 2, 3], 3),  # token ids count one each
        ([[1, 2], [3, 4, 5]], 5),
        (["abcdefgh", 7], 3),  # 8 bytes -> 2, plus one token id
        ([], 0),
        (None, 0),
    ],
)
def test_completions_input_token_estimate(prompt: Any, tokens: int) -> None:
    assert estimate_input_tokens(completions(prompt).body) == tokens


def test_chat_estimate_is_json_of_messages_and_other_apis_decline() -> None:
    # [{"role":"user","content":"hi"}] is 32 characters
    assert estimate_input_tokens(chat([{"role": "user", "content": "hi"}]).body) == 8
    req = factories.request({"model": "m", "input": "x" * 4000}, api=ApiKind.RESPONSES, request_id="r")
    assert estimate_input_tokens(req.body) is None
    decode = ep(0, "decode")
    assert prefix_decider(1).disaggregate(with_match(decode, 0, 16), req, decode) is False


def test_prefix_decider_drives_the_handler_from_the_decode_endpoints_cache() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill")]
    handler = disagg(prefix_decider(50), params=nested(prefill="prefix"))
    req = completions("a" * 400)  # 100 tokens

    cycle = with_match(pool[0], 4, 16)  # 64 cached -> 36 uncached < 50
    result, _ = Scheduler(handler, {"decode": stage("decode"), "prefill": stage("prefill")}).schedule(
        cycle, req, pool
    )
    assert result is not None and set(result.profile_results) == {"decode"}

    cycle = with_match(pool[0], 1, 16)  # 16 cached -> 84 uncached
    result, _ = Scheduler(handler, {"decode": stage("decode"), "prefill": stage("prefill")}).schedule(
        cycle, req, pool
    )
    assert result is not None and targets(result, "prefill") == [pool[1]]


@pytest.mark.parametrize("block", ["image_url", "video_url", "input_audio"])
def test_multimodal_decider_detects_media_blocks(block: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": block}]}]
    assert AlwaysDisaggMultimodalDecider("mm", None).disaggregate(CycleState(), chat(messages), ep(0, None))


@pytest.mark.parametrize(
    "request_",
    [
        chat([{"role": "user", "content": "image_url"}]),
        chat([{"role": "user", "content": [{"type": "text", "text": "image_url"}]}]),
        chat(["not a message"]),
        completions("image_url"),
    ],
)
def test_multimodal_decider_ignores_text(request_: LLMRequest) -> None:
    assert not AlwaysDisaggMultimodalDecider("mm", None).disaggregate(CycleState(), request_, ep(0, None))


# --- parameters and decider lookup ------------------------------------------------------------


def test_mixing_flat_and_nested_parameters_is_an_error_naming_the_flat_key() -> None:
    raw = {"deciders": {"prefill": "x"}, "prefillProfile": "p"}
    with pytest.raises(ConfigError) as info:
        decode_params(DisaggParams, raw, "plugins[1].parameters")
    assert info.value.field == "plugins[1].parameters.prefillProfile"
    assert info.value.reason.startswith(
        "cannot mix deprecated flat parameters (decodeProfile, prefillProfile"
    )
    assert info.value.reason.endswith(
        "with nested parameters (profiles, deciders): use one format or the other"
    )
    # built directly (not through the loader), the handler refuses the mix as well
    mixed = DisaggParams(profiles=DisaggProfiles(decode="d"), encode_profile="e")
    with pytest.raises(ConfigError, match="cannot mix"):
        DisaggProfileHandler("h", mixed, StubHandle())


def test_flat_parameters_are_promoted_and_round_trip() -> None:
    raw = {"prefillDeciderPluginName": "a", "deciderPluginName": "b", "encodeDeciderPluginName": "c"}
    params = decode_params(DisaggParams, raw, "p")
    assert params.deciders == DisaggDeciders(prefill="b", encode="c")  # deciderPluginName wins
    assert params.profiles == DisaggProfiles("decode", "prefill", "encode")
    assert params.decider_plugin_name == "" and params.validate() is None
    assert decode_params(DisaggParams, encode_params(params), "p") == params
    assert decode_params(DisaggParams, None, "p").profiles == DisaggProfiles("decode", "prefill", "encode")


@pytest.mark.parametrize(
    ("deciders", "field_path", "message"),
    [
        (DisaggDeciders(prefill="missing"), "deciders.prefill", "deciders.prefill plugin not found: missing"),
        (DisaggDeciders(encode="missing"), "deciders.encode", "deciders.encode plugin not found: missing"),
        (
            DisaggDeciders(prefill="queue"),
            "deciders.prefill",
            "plugin queue does not implement prefillDeciderPlugin",
        ),
        (
            DisaggDeciders(encode="queue"),
            "deciders.encode",
            "plugin queue does not implement encodeDeciderPlugin",
        ),
    ],
)
def test_decider_lookup_errors(deciders: DisaggDeciders, field_path: str, message: str) -> None:
    handle = StubHandle(QueueScorer("queue", None), AlwaysDisaggDecider("always", None))
    with pytest.raises(ConfigError) as info:
        DisaggProfileHandler("h", DisaggParams(deciders=deciders), handle)
    assert info.value.field == field_path
    assert info.value.reason == message


def test_a_duck_typed_decider_is_accepted() -> None:
    class _Duck(Plugin):
        type_name = "duck"

        def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
            return True

    pool = [ep(0, "decode"), ep(1, "both")]
    handler = DisaggProfileHandler("h", nested(prefill="duck"), StubHandle(_Duck("duck", None)))
    result, _ = run(handler, [stage("decode"), stage("prefill")], completions(), pool)
    assert result is not None and targets(result, "prefill") == [pool[1]]


def test_registered_types_and_alias() -> None:
    assert registry.lookup("disagg-profile-handler") is DisaggProfileHandler
    assert registry.lookup("pd-profile-handler") is PdProfileHandler
    assert registry.lookup("data-parallel-profile-handler") is DataParallelProfileHandler
    assert registry.lookup("disagg-headers-handler") is DisaggHeadersHandler
    assert registry.lookup("prefill-header-handler") is DisaggHeadersHandler
    assert registry.lookup("prefix-based-pd-decider") is PrefixBasedPDDecider
    assert registry.lookup("always-disagg-pd-decider") is AlwaysDisaggDecider
    assert registry.lookup("always-disagg-multimodal-decider") is AlwaysDisaggMultimodalDecider


# --- pd-profile-handler and disagg-headers-handler ----------------------------------------------


def pd(decider: Plugin, **params: Any) -> PdProfileHandler:
    return PdProfileHandler("pd", PdParams(decider_plugin_name=decider.name, **params), StubHandle(decider))


def test_pd_handler_keeps_prefill_leaves_headers_to_the_headers_handler() -> None:
    pool = [ep(0, "decode"), ep(1, "prefill")]
    handler = pd(AlwaysDisaggDecider("always", None))
    before = (count(PD_METRIC, "prefill-decode"), count(DISAGG_METRIC, "prefill-decode"))
    req = completions(headers={PREFILL_HEADER: "6.6.6.6:1"})

    result, err = run(handler, [stage("decode"), stage("prefill")], req, pool)

    assert err is None and result is not None
    assert result.primary_profile_name == "decode"
    assert targets(result, "prefill") == [pool[1]]
    assert req.headers == {PREFILL_HEADER: "6.6.6.6:1"}  # the pd handler writes no header
    assert count(PD_METRIC, "prefill-decode") == before[0] + 1
    assert count(DISAGG_METRIC, "prefill-decode") == before[1]  # only the deprecated counter
    DisaggHeadersHandler("hh", DisaggHeadersParams()).pre_request(CycleState(), req, result)
    assert req.headers == {PREFILL_HEADER: "10.0.0.1:8000"}


def test_pd_handler_failed_prefill_counts_decode_only_and_failed_decode_errors() -> None:
    handler = pd(AlwaysDisaggDecider("always", None))
    before = count(PD_METRIC, "decode-only")
    result, err = run(
        handler, [stage("decode"), stage("prefill", fail=True)], completions(), [ep(0, "decode")]
    )
    assert err is None and result is not None and set(result.profile_results) == {"decode"}
    assert count(PD_METRIC, "decode-only") == before + 1

    result, err = run(handler, [stage("decode"), stage("prefill")], completions(), [ep(0, "prefill")])
    assert result is None and str(err) == "failed to find available decode workers"


def test_pd_handler_runs_prefill_once_with_an_extra_profile() -> None:
    extra = stage("decode")
    extra.name = "other"
    prefill = stage("prefill")
    handler = pd(AlwaysDisaggDecider("always", None))
    result, err = run(
        handler, [stage("decode"), prefill, extra], completions(), [ep(0, "decode"), ep(1, "prefill")]
    )
    assert err is None and result is not None
    assert prefill.runs == [True] and extra.runs == []


def test_pd_handler_primary_port_rewrites_decode_and_names_the_rank() -> None:
    rank = ep(5, "decode", port=8003)
    handler = pd(_Fixed("no", False), primary_port=8000)
    req = completions()
    result, err = run(handler, [stage("decode"), stage("prefill")], req, [rank, ep(1, "prefill")])
    assert err is None and result is not None
    (chosen,) = targets(result, "decode")
    assert chosen.hostport == "10.0.0.5:8000"
    assert req.headers[DP_HEADER] == "10.0.0.5:8003"


@pytest.mark.parametrize(
    ("raw", "field_path", "reason"),
    [
        ({"deciderPluginName": ""}, "deciderPluginName", "decider plugin name is not defined"),
        (
            {"deciderPluginName": "", "primaryPort": 8000},
            "deciderPluginName",
            "decider plugin name is not defined",
        ),
        (
            {"primaryPort": 70000},
            "primaryPort",
            "invalid primaryPort: must be between 1 and 65535, got 70000",
        ),
        ({"primaryPort": -1}, "primaryPort", "invalid primaryPort: must be between 1 and 65535, got -1"),
    ],
)
def test_pd_parameter_errors(raw: dict[str, Any], field_path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_params(PdParams, raw, "plugins[1].parameters")
    assert info.value.field == f"plugins[1].parameters.{field_path}"
    assert info.value.reason == reason


def test_pd_decider_lookup_errors() -> None:
    params = PdParams()  # default decider name: prefix-based-pd-decider, which must exist
    with pytest.raises(ConfigError) as info:
        PdProfileHandler("pd", params, StubHandle())
    assert (info.value.field, info.value.reason) == (
        "deciderPluginName",
        "invalid decider plugin type: prefix-based-pd-decider",
    )
    with pytest.raises(ConfigError) as info:
        PdProfileHandler("pd", PdParams(decider_plugin_name="queue"), StubHandle(QueueScorer("queue", None)))
    assert info.value.reason == "decider plugin of type: queue does not implement pdDeciderPlugin"
    decider = PrefixBasedPDDecider("prefix-based-pd-decider", PrefixBasedPDDeciderParams(16))
    handler = PdProfileHandler("pd", params, StubHandle(decider))
    assert handler.decider is decider
    assert handler.validate_profiles(["prefill"]) is not None
    assert handler.validate_profiles(["prefill", "decode"]) is None


def test_headers_handler_with_custom_profile_names() -> None:
    req = completions(headers={ENCODERS_HEADER: "6.6.6.6:1"})
    result = SchedulingResult(
        {
            "d": ProfileRunResult([ep(0, "decode")]),
            "my-prefill": ProfileRunResult([ep(1, "prefill"), ep(2, "prefill")]),
            "my-encode": ProfileRunResult([]),
        },
        "d",
    )
    handler = DisaggHeadersHandler(
        "hh", DisaggHeadersParams(prefill_profile="my-prefill", encode_profile="my-encode")
    )
    handler.pre_request(CycleState(), req, result)
    assert req.headers == {PREFILL_HEADER: "10.0.0.1:8000"}  # first prefill endpoint; empty encode: none


# --- data-parallel-profile-handler -------------------------------------------------------------


def dp_profile() -> SchedulerProfile:
    return SchedulerProfile(
        "default",
        scorers=[WeightedScorer(QueueScorer("q", None))],
        picker=MaxScorePicker("m", PickerParams()),
    )


def test_data_parallel_rewrites_port_and_sets_rank_header() -> None:
    pool = [ep(1, None, queue=4, port=8001), ep(1, None, queue=0, port=8002)]
    pool[1].attributes["x"] = 1
    handler = DataParallelProfileHandler("dp", DataParallelParams(primary_port=8000))
    req = completions(headers={DP_HEADER: "6.6.6.6:1"})

    result, err = Scheduler(handler, {"default": dp_profile()}).schedule(CycleState(), req, pool)

    assert err is None and result is not None
    (chosen,) = targets(result, "default")
    assert chosen.hostport == "10.0.0.1:8000"
    assert chosen.metadata.name == pool[1].metadata.name and chosen.attributes == {}
    assert req.headers[DP_HEADER] == "10.0.0.1:8002"
    assert isinstance(chosen, PortRewrittenEndpoint) and chosen.origin is pool[1]
    chosen.inflight += 1  # what the director does when the reply is sent
    assert pool[1].inflight == 1 and pool[0].inflight == 0
    chosen.inflight -= 1
    assert pool[1].inflight == 0
    assert pool[1].metadata.port == 8002  # the live endpoint is untouched


def test_data_parallel_errors_and_validation() -> None:
    handler = DataParallelProfileHandler("dp", DataParallelParams())
    _, err = handler.process_results(CycleState(), completions(), {"a": None})
    assert str(err) == "failed to run scheduler profile 'a'"
    two = {"a": ProfileRunResult([ep(0, None)]), "b": ProfileRunResult([ep(1, None)])}
    _, err = handler.process_results(CycleState(), completions(), two)
    assert str(err).startswith("data parallel profile handler is intended to be used with a single profile")
    assert (
        handler.pick_profiles(CycleState(), completions(), {"a": dp_profile(), "b": dp_profile()}, {}) == {}
    )
    assert handler.validate_profiles(["a", "b"]) is not None
    assert handler.validate_profiles(["a"]) is None
    for bad in (0, 65536):
        with pytest.raises(ConfigError, match="must be between 1 and 65535"):
            decode_params(DataParallelParams, {"primaryPort": bad}, "p")


# --- properties ---------------------------------------------------------------------------------

DECIDER = st.sampled_from([None, True, False])


@settings(max_examples=300, deadline=None)
@given(
    roles=st.lists(st.sampled_from([None, *ALL_ROLES]), min_size=0, max_size=8),
    queues=st.lists(st.integers(0, 20), min_size=8, max_size=8),
    fail=st.fixed_dictionaries({"decode": st.booleans(), "prefill": st.booleans(), "encode": st.booleans()}),
    present=st.fixed_dictionaries({"prefill": st.booleans(), "encode": st.booleans()}),
    answers=st.fixed_dictionaries({"prefill": DECIDER, "encode": DECIDER}),
    spoofed=st.booleans(),
)
def test_property_pd_invariants(
    roles: list[str | None],
    queues: list[int],
    fail: dict[str, bool],
    present: dict[str, bool],
    answers: dict[str, bool | None],
    spoofed: bool,
) -> None:
    pool = [ep(i, role, queue=queues[i]) for i, role in enumerate(roles)]
    deciders = {s: _Fixed(f"{s}-decider", a) for s, a in answers.items() if a is not None}
    handler = disagg(
        *deciders.values(),
        params=nested(
            prefill=deciders["prefill"].name if "prefill" in deciders else "",
            encode=deciders["encode"].name if "encode" in deciders else "",
        ),
    )
    profiles = {"decode": stage("decode", fail["decode"])}
    profiles.update({s: stage(s, fail[s]) for s in ("prefill", "encode") if present[s]})
    headers = {PREFILL_HEADER: "6.6.6.6:1", ENCODERS_HEADER: "6.6.6.6:2"} if spoofed else {}
    req = completions(headers=headers)

    result, err = Scheduler(handler, profiles).schedule(CycleState(), req, pool)

    def can_serve(name: str) -> bool:
        roles_, keep = STAGE_ROLES[name]
        return not fail[name] and any(_passes(e, roles_, keep) for e in pool)

    decode_ok = can_serve("decode")
    # (3) the request fails iff decode failed
    assert (err is not None) == (not decode_ok)
    assert (result is None) == (not decode_ok)
    # (2) a profile that ran and failed is an explicit None entry; one that ran and succeeded is not
    for name, prof in profiles.items():
        assert len(prof.runs) <= 1
        if prof.runs:
            assert name in handler.seen
            assert (handler.seen[name] is None) == (not prof.runs[0])
    # the stage model: optional stages run only after a good decode, when their decider agrees
    for s in ("prefill", "encode"):
        if s in profiles:
            assert bool(profiles[s].runs) == (decode_ok and answers[s] is True)
    if result is None:
        assert set(handler.seen) == {"decode"}
        return
    assert err is None
    # (1) every picked endpoint is a candidate that passed its profile's filters
    for name, res in result.profile_results.items():
        assert res is not None and res.target_endpoints
        roles_, keep = STAGE_ROLES[name]
        assert not fail[name]
        for e in res.target_endpoints:
            assert any(e is c for c in pool)
            assert _passes(e, roles_, keep)
    handler.pre_request(CycleState(), req, result)
    prefill_ok = "prefill" in profiles and profiles["prefill"].runs == [True]
    # (4) a failed or skipped prefill leaves no prefill endpoints and no prefill header
    if not prefill_ok:
        assert "prefill" not in result.profile_results
        assert PREFILL_HEADER not in req.headers
    else:
        assert req.headers[PREFILL_HEADER] == targets(result, "prefill")[0].hostport
    encode_ok = "encode" in profiles and profiles["encode"].runs == [True]
    assert (ENCODERS_HEADER in req.headers) == encode_ok


# --- new parameters: promptTokens, stageOrder ----------------------------------------------------


def test_prefix_decider_prompt_tokens_is_a_minimum_prompt_length() -> None:
    decode = ep(0, "decode")
    decider = PrefixBasedPDDecider(
        "d", decode_params(PrefixBasedPDDeciderParams, {"nonCachedTokens": 10, "promptTokens": 100}, "p")
    )
    cycle = with_match(decode, 0, 16)
    assert decider.disaggregate(cycle, completions("a" * 396), decode) is False  # 99 tokens < 100
    assert decider.disaggregate(cycle, completions("a" * 400), decode) is True
    with pytest.raises(ConfigError) as info:
        decode_params(PrefixBasedPDDeciderParams, {"promptTokens": -1}, "plugins[0].parameters")
    assert info.value.field == "plugins[0].parameters.promptTokens"
    assert "cannot be negative" in info.value.reason


def test_stage_order_prefill_first_runs_prefill_then_decode_with_the_prefill_peer() -> None:
    from epp.plugins.profile_handlers.disagg import PEER_ENDPOINT_KEY

    pool = [ep(0, "decode", queue=1), ep(1, "decode"), ep(2, "prefill", queue=2), ep(3, "prefill")]
    params = decode_params(DisaggParams, {"stageOrder": "prefill-first"}, "p")
    handler = disagg(params=params)
    seen: list[Any] = []

    class _PeerSpy(Filter):
        type_name = "test-peer-spy"

        def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
            seen.append(cycle.get(PEER_ENDPOINT_KEY))
            return endpoints

    decode, prefill = stage("decode"), stage("prefill")
    decode.filters.append(_PeerSpy("spy", None))
    before = count(DISAGG_METRIC, "prefill-decode")
    req = completions()
    result, err = run(handler, [decode, prefill], req, pool)
    assert err is None and result is not None
    assert (prefill.runs, decode.runs) == ([True], [True])
    assert targets(result, "prefill") == [pool[3]] and targets(result, "decode") == [pool[1]]
    assert seen == [pool[3]]  # decode ran after prefill and saw its pick as the peer
    assert result.primary_profile_name == "decode"
    assert count(DISAGG_METRIC, "prefill-decode") == before + 1

    # no prefill endpoint: decode-only
    result, err = run(disagg(params=params), [stage("decode"), stage("prefill")], req, pool[:2])
    assert err is None and result is not None and set(result.profile_results) == {"decode"}


def test_stage_order_values_and_errors() -> None:
    for raw, expected in (
        ("decode", "decode-first"),
        ("PREFILL_FIRST", "prefill-first"),
        ("", "decode-first"),
    ):
        assert decode_params(DisaggParams, {"stageOrder": raw}, "p").stage_order == expected
    with pytest.raises(ConfigError) as info:
        decode_params(DisaggParams, {"stageOrder": "sideways"}, "plugins[0].parameters")
    assert info.value.field == "plugins[0].parameters.stageOrder"
    with pytest.raises(ConfigError) as info:
        decode_params(
            DisaggParams,
            {"stageOrder": "prefill-first", "deciders": {"prefill": "x"}},
            "plugins[0].parameters",
        )
    assert info.value.field == "plugins[0].parameters.deciders.prefill"
    assert "not supported in prefill-first" in info.value.reason


def test_decode_first_publishes_the_decode_pick_as_the_prefill_peer() -> None:
    from epp.plugins.profile_handlers.disagg import PEER_ENDPOINT_KEY

    pool = [ep(0, "decode"), ep(1, "prefill")]
    handler = disagg(AlwaysDisaggDecider("always", None), params=nested(prefill="always"))
    cycle = CycleState()
    _, err = Scheduler(handler, {"decode": stage("decode"), "prefill": stage("prefill")}).schedule(
        cycle, completions(), pool
    )
    assert err is None and cycle[PEER_ENDPOINT_KEY] is pool[0]
