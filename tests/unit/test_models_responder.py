"""``models-responder``: ``GET /v1/models`` from the data layer, the model screen, the source it adds."""

from __future__ import annotations

import orjson
import pytest

from epp.framework import InferenceError
from epp.framework.endpoint_attributes import MODELS_KEY, ModelData
from epp.plugins.request_control.models_responder import ModelsResponder
from tests.unit.factories import completions, config, endpoints


def _pool() -> list:  # type: ignore[type-arg]
    eps = endpoints(3)
    eps[1].attributes[MODELS_KEY] = (ModelData("base", "model", 7, "vllm"), ModelData("sql", parent="base"))
    eps[0].attributes[MODELS_KEY] = (ModelData("base", "model", 1, "vllm"), ModelData("law", parent="base"))
    return eps  # eps[2] not polled yet


def test_get_models_answers_the_sorted_union_first_endpoint_winning() -> None:
    answer = ModelsResponder("r").respond("GET", "/v1/models/", _pool())
    assert answer is not None and answer.status == 200
    assert answer.headers["content-type"] == "application/json"
    body = orjson.loads(answer.body)
    assert body["object"] == "list"
    assert body["data"] == [
        {"id": "base", "object": "model", "created": 1, "owned_by": "vllm"},  # e0's copy (lowest key)
        {"id": "law"},
        {"id": "sql"},
    ]


def test_other_requests_are_declined_and_no_data_is_503() -> None:
    r = ModelsResponder("r")
    assert r.respond("POST", "/v1/models", _pool()) is None
    assert r.respond("GET", "/v1/models/x", _pool()) is None
    assert r.respond("GET", "/health", _pool()) is None
    with pytest.raises(InferenceError) as info:
        r.respond("GET", "/v1/models", endpoints(2))
    assert info.value.code.http_status == 503
    empty = endpoints(1)
    empty[0].attributes[MODELS_KEY] = ()
    answer = r.respond("GET", "/v1/models", empty)
    assert answer is not None and orjson.loads(answer.body) == {"object": "list", "data": []}


def test_screen_keeps_the_endpoints_serving_the_target() -> None:
    r, eps = ModelsResponder("r"), _pool()
    assert r.screen(completions(model="sql"), eps) == [eps[1]]  # an adapter: listed endpoints only
    assert r.screen(completions(model="base"), eps) == [eps[0], eps[1], eps[2]]  # base: + unreported
    assert r.screen(completions(model="nope"), eps) == [eps[2]]  # nobody lists it: the unreported
    assert r.screen(completions(model="nope"), eps[:2]) == eps[:2]  # all reported: the lists may lag
    assert r.screen(completions(model=""), eps) == eps


def test_a_models_source_is_added_unless_one_is_configured() -> None:
    body = "plugins:\n- type: models-responder\n"
    loaded = config(body)
    pairs = {s.type_name: [e.type_name for e in ex] for s, ex in loaded.data_sources}
    assert pairs["models-data-source"] == ["models-data-extractor"]
    own = config(
        body + "- type: models-data-source\n  name: tls-models\n  parameters: {scheme: https}\n"
        "- type: models-data-extractor\n"
        "dataLayer:\n  sources:\n  - pluginRef: tls-models\n"
        "    extractors: [{pluginRef: models-data-extractor}]\n"
    )
    assert [s.name for s, _ in own.data_sources if s.type_name == "models-data-source"] == ["tls-models"]
    assert loaded.responders and loaded.screeners
