"""``outlen-bucket``: the output-length bucket of a request, and the in-flight load estimated from it."""

from __future__ import annotations

from typing import Any

import pytest

from epp.framework.attributes import OUTLEN_BUCKET_KEY
from epp.plugins.producers.inflight_load import estimate_output_tokens
from epp.plugins.request_control.outlen_bucket import LONG, SHORT, UNKNOWN, OutlenBucket, classify
from tests.unit.factories import chat, completions, config

TOOLS = [{"type": "function", "function": {"name": "f"}}]


def _chat(rid: str = "r1", **fields: Any):  # type: ignore[no-untyped-def]
    req = chat([{"role": "user", "content": "hi"}], request_id=rid)
    req.body.payload.update(fields)  # type: ignore[attr-defined]
    return req


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"chat_template_kwargs": {"enable_thinking": True}}, LONG),
        ({"chat_template_kwargs": {"enable_thinking": "true"}, "tools": TOOLS}, LONG),  # thinking beats tools
        ({"chat_template_kwargs": {"thinking_budget": 8000}}, LONG),
        ({"chat_template_kwargs": {"thinking_budget": 4000}}, UNKNOWN),  # not above 4000
        ({"chat_template_kwargs": {"enable_thinking": False, "thinking_budget": 8000}}, UNKNOWN),
        ({"tools": TOOLS}, SHORT),
        ({"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": 0}}, SHORT),
        ({"tools": []}, UNKNOWN),
        ({"max_tokens": 200}, SHORT),
        ({"max_completion_tokens": 499}, SHORT),
        ({"max_tokens": 500}, UNKNOWN),
        ({"max_tokens": 0}, UNKNOWN),
        ({}, UNKNOWN),
    ],
)
def test_chat_buckets(fields: dict[str, Any], want: str) -> None:
    assert classify(_chat(**fields)) == want


def test_thinking_signals_are_read_only_from_chat_requests() -> None:
    req = completions(chat_template_kwargs={"enable_thinking": True})
    assert classify(req) == UNKNOWN
    assert classify(completions(max_tokens=10)) == SHORT


def test_the_bucket_drives_the_output_estimate() -> None:
    req = _chat(chat_template_kwargs={"enable_thinking": True})
    assert estimate_output_tokens(req, 100) == 150  # no bucket: the 1.5 ratio
    OutlenBucket("o").request_header(req)
    assert req.state[OUTLEN_BUCKET_KEY] == LONG
    assert estimate_output_tokens(req, 100) == 4096
    assert estimate_output_tokens(req, 100, cap=1000) == 1000  # the operator cap
    short = _chat(tools=TOOLS, max_tokens=50)
    OutlenBucket("o").request_header(short)
    assert estimate_output_tokens(short, 10_000) == 50  # the client cap, below SHORT's 100
    unknown = _chat()
    OutlenBucket("o").request_header(unknown)
    assert estimate_output_tokens(unknown, 10_000) == 1000


def test_it_is_an_alpha_request_header_processor() -> None:
    body = "plugins:\n- type: outlen-bucket\n"
    loaded = config(body, allow_experimental=True)
    assert [p.type_name for p in loaded.request_header] == ["outlen-bucket"]
    with pytest.raises(Exception, match=r"experimental"):
        config(body, allow_experimental=False)


async def test_token_load_scorer_sees_the_bucketed_load() -> None:
    from epp.framework import CycleState, ProfileRunResult, SchedulingResult
    from epp.plugins.producers.inflight_load import InFlightLoadParams, InFlightLoadProducer
    from epp.plugins.scorers.token_load import TokenLoadParams, TokenLoadScorer
    from tests.unit.factories import endpoints

    params = InFlightLoadParams(add_estimated_output_tokens=True)
    prod = InFlightLoadProducer("inflight-load-producer", params)
    eps = endpoints(2)
    sent = [_chat("a", chat_template_kwargs={"enable_thinking": True}), _chat("b", tools=TOOLS)]
    for req, target in zip(sent, eps, strict=True):  # kept alive: a dropped request releases its load
        OutlenBucket("o").request_header(req)
        prod.pre_request(CycleState(), req, SchedulingResult({"d": ProfileRunResult([target])}, "d"))
    cycle = CycleState()
    await prod.produce(cycle, _chat("c"), eps)
    scores = TokenLoadScorer("t", TokenLoadParams(queue_threshold_tokens=10_000)).score(cycle, _chat(), eps)
    assert scores[1] > scores[0]  # the thinking request weighs 4096 output tokens, the tool call 100
    assert scores[0] < 0.6 < scores[1]
