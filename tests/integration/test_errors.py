"""EPP errors reach the client through Envoy as OpenAI-style JSON errors with the right status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import BODY_MODES, Envoy, Response, Rig, chat_body, marker

pytestmark = pytest.mark.integration


def _error_message(resp: Response) -> str:
    data = resp.json()
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), resp.body
    message = data["error"]["message"]
    assert isinstance(message, str)
    return message


def test_malformed_json_is_a_400(envoy: Envoy) -> None:
    resp = envoy.post("/v1/chat/completions", b'{"model": "demo", "messages": [')
    assert resp.status == 400, resp
    assert "inference error: BadRequest" in _error_message(resp)


def test_body_that_is_not_an_object_is_a_400(envoy: Envoy) -> None:
    resp = envoy.post("/v1/completions", b"no healthy upstream")
    assert resp.status == 400, resp
    assert "inference error: BadRequest" in _error_message(resp)


def test_missing_model_is_a_400(envoy: Envoy) -> None:
    resp = envoy.post("/v1/chat/completions", chat_body(marker(), model=None))
    assert resp.status == 400, resp
    message = _error_message(resp)
    assert "inference error: BadRequest" in message
    assert "model" in message


def test_missing_prompt_is_a_400(envoy: Envoy) -> None:
    resp = envoy.post("/v1/completions", json.dumps({"model": "demo"}).encode())
    assert resp.status == 400, resp
    assert "inference error: BadRequest" in _error_message(resp)


@pytest.fixture(scope="module")
def empty_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Envoy]]:
    """An EPP whose endpoints file lists nothing, behind one Envoy per body mode."""
    rig = Rig(Path(tmp_path_factory.mktemp("empty")) / "logs")
    try:
        epp = rig.start_epp([], name="epp-empty")
        yield {
            mode: rig.start_envoy(
                epp, body_mode=mode, name=f"envoy-empty-{mode.lower()}", wait_for_traffic=False
            )
            for mode in BODY_MODES
        }
    finally:
        rig.close()


@pytest.mark.parametrize("mode", BODY_MODES)
def test_empty_pool_is_a_503(empty_pool: dict[str, Envoy], mode: str) -> None:
    resp = empty_pool[mode].post("/v1/chat/completions", chat_body(marker()))
    assert resp.status == 503, resp
    assert "inference error: ServiceUnavailable" in _error_message(resp)


@pytest.mark.parametrize("mode", BODY_MODES)
def test_empty_pool_get_is_a_5xx(empty_pool: dict[str, Envoy], mode: str) -> None:
    resp = empty_pool[mode].get("/v1/models")
    assert 500 <= resp.status < 600, resp
