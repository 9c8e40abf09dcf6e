"""``header-profile-handler``: one scheduling profile per request, named by a header."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from epp.config import load_config
from epp.datalayer.store import EndpointStore
from epp.framework import CycleState, Endpoint, ErrorCode, Filter, InferenceError, LLMRequest, Stability
from epp.framework.params import decode_params
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.profile_handlers.header_profile import HeaderProfileHandler, HeaderProfileParams
from epp.scheduling import Scheduler, SchedulerProfile
from epp.server.director import Director
from tests.unit.factories import endpoint, metadata, request

PICKER = MaxScorePicker("picker", PickerParams())


def handler(raw: dict[str, Any] | None = None) -> HeaderProfileHandler:
    return HeaderProfileHandler("h", decode_params(HeaderProfileParams, raw, "p"))


def scheduler(h: HeaderProfileHandler, *names: str) -> tuple[Scheduler, dict[str, Any]]:
    """Profiles over one endpoint each, named like the profile."""
    pool = {n: endpoint(n, f"10.0.0.{i}") for i, n in enumerate(names)}

    profiles = {n: SchedulerProfile(n, filters=[_NameFilter(n)], scorers=[], picker=PICKER) for n in names}
    return Scheduler(h, profiles), pool


class _NameFilter(Filter):
    type_name = "test-name-filter"

    def __init__(self, keep: str) -> None:
        super().__init__(keep, None)
        self.keep = keep

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return [e for e in endpoints if e.metadata.name == self.keep]


def served(h: HeaderProfileHandler, headers: dict[str, str], *names: str) -> Any:
    sched, pool = scheduler(h, *names)
    return sched.schedule(CycleState(), request(headers=headers), list(pool.values()))


def test_header_names_the_profile_and_it_is_primary() -> None:
    h = handler()
    result, err = served(h, {"epp-profile": "prefill"}, "encode", "prefill", "decode")
    assert err is None and result is not None
    assert result.primary_profile_name == "prefill"
    assert list(result.profile_results) == ["prefill"]
    assert result.primary.target_endpoints[0].metadata.name == "prefill"


def test_missing_or_blank_header_runs_the_default_profile() -> None:
    for headers in ({}, {"epp-profile": "   "}):
        result, err = served(handler(), headers, "prefill", "decode")
        assert err is None and result.primary_profile_name == "decode"
    custom = handler({"headerName": "X-Stage", "defaultProfile": "prefill"})
    result, err = served(custom, {}, "prefill", "decode")
    assert result.primary_profile_name == "prefill"
    result, err = served(custom, {"x-stage": "decode"}, "prefill", "decode")
    assert result.primary_profile_name == "decode"
    result, err = served(custom, {"epp-profile": "decode"}, "prefill", "decode")  # not its header
    assert result.primary_profile_name == "prefill"


def test_one_profile_always_runs() -> None:
    result, err = served(handler(), {"epp-profile": "nope"}, "only")
    assert err is None and result.primary_profile_name == "only"


def test_unknown_profile_or_missing_default_is_a_bad_request() -> None:
    result, err = served(handler(), {"epp-profile": "nope"}, "prefill", "decode")
    assert result is None and isinstance(err, InferenceError)
    assert err.code is ErrorCode.BAD_REQUEST and '"nope"' in err.message
    result, err = served(handler({"defaultProfile": "gone"}), {}, "prefill", "decode")
    assert isinstance(err, InferenceError) and err.code is ErrorCode.BAD_REQUEST
    assert 'defaultProfile "gone"' in err.message


def test_director_answers_the_handlers_bad_request_as_400() -> None:
    text = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: header-profile-handler}
- {type: max-score-picker}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: max-score-picker}]}
- {name: prefill, plugins: [{pluginRef: max-score-picker}]}
"""
    cfg = load_config(text, environ={})
    assert isinstance(cfg.scheduler.handler, HeaderProfileHandler)
    assert HeaderProfileHandler.stability is Stability.ALPHA
    store = EndpointStore()
    store.upsert(metadata("e0"))
    director = Director(store, cfg.parsers, cfg.scheduler)
    body = b'{"model": "m", "prompt": "hi"}'
    with pytest.raises(InferenceError) as info:
        asyncio.run(director.route({"epp-profile": "bogus", ":path": "/v1/completions"}, body, {}))
    assert info.value.code.http_status == 400
    routed = asyncio.run(director.route({"epp-profile": "prefill", ":path": "/v1/completions"}, body, {}))
    assert routed.result is not None and routed.result.primary_profile_name == "prefill"
