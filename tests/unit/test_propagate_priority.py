"""``requestHandler.propagatePriority``: the request's priority written into the body's ``priority``
(negated for vLLM endpoints), only when on; the body keeps every other byte."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.store import EndpointStore
from epp.server.body_rewrite import set_members
from epp.server.director import Director
from tests.unit import factories

POOL = "pool"
CHAT = b'{"model":"demo", "messages":[{"role":"user","content":"hi"}],"priority":7}'
PATH = {":path": "/v1/chat/completions"}


def _director(engine: str | None, *, on: bool) -> Director:
    store = EndpointStore()
    labels = {"llm-d.ai/engine-type": engine} if engine else {}
    store.upsert(factories.metadata("e0", labels=labels))
    objectives = ObjectiveStore(pool_name=POOL)
    spec: dict[str, Any] = {"poolRef": {"group": "inference.networking.k8s.io", "name": POOL}, "priority": 5}
    objectives.upsert_object({"metadata": {"name": "critical"}, "spec": spec})
    director = factories.director(store, objectives=objectives)
    director.propagate_priority = on
    return director


@pytest.mark.parametrize(("engine", "want"), [("vllm", -5), ("sglang", 5), (None, 5)])
async def test_the_priority_is_written_negated_for_vllm(engine: str | None, want: int) -> None:
    director = _director(engine, on=True)
    routing = await director.route({**PATH, "x-gateway-inference-objective": "critical"}, CHAT, {})
    body = json.loads(routing.body)
    assert body["priority"] == want and body["messages"][0]["content"] == "hi"
    assert routing.body_changed and not routing.model_changed  # no response-body model reversal
    assert routing.body == CHAT.replace(b'"priority":7', f'"priority":{want}'.encode())


async def test_off_leaves_the_body_untouched() -> None:
    routing = await _director("vllm", on=False).route(
        {**PATH, "x-gateway-inference-objective": "critical"}, CHAT, {}
    )
    assert routing.body is CHAT and not routing.body_changed


async def test_a_missing_priority_is_added_and_combines_with_a_model_rewrite() -> None:
    director = _director("vllm", on=True)
    raw = b'{"model":"demo","messages":[{"role":"user","content":"x"}]}'
    routing = await director.route({**PATH, "x-gateway-model-name-rewrite": "other"}, raw, {})
    assert json.loads(routing.body) == {
        "priority": 0,
        "model": "other",
        "messages": [{"role": "user", "content": "x"}],
    }
    assert routing.model_changed


def test_set_members_edits_top_level_members_only() -> None:
    body = b'{"a":{"priority":1}, "priority" : 2, "model":"m"}'
    assert set_members(body, {"priority": "-3"}) == b'{"a":{"priority":1}, "priority" : -3, "model":"m"}'
    assert set_members(b"{}", {"priority": "1"}) == b'{"priority":1}'
    with pytest.raises(ValueError):
        set_members(b"[1]", {"priority": "1"})


def test_the_field_is_read_and_shown_in_the_effective_config() -> None:
    loaded = factories.config("requestHandler:\n  propagatePriority: true\n")
    assert loaded.propagate_priority
    assert "propagatePriority: true" in loaded.effective_yaml()
    assert not factories.config("").propagate_priority
    err = factories.config_error("requestHandler:\n  propagatePriority: yes please\n")
    assert err.field == "requestHandler.propagatePriority"
