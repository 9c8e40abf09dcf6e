"""``requestHandler.parsers`` through a real Envoy: the parser is chosen per request by path suffix.

The EPP lists ``openai-parser``, ``anthropic-parser`` and ``passthrough-parser``: an Anthropic
``/v1/messages`` request is parsed (its model reaches the EPP's metrics, a bad body is a 400 from
the EPP), a path no parser claims is forwarded unread by the passthrough fallback. The simulators
do not serve those paths: they answer 404 after journaling the request, so the assertions are on the
routing (which simulator got it, with which destination header and body). A second EPP lists no
fallback: an unclaimed path is a 400 naming it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.harness import BODY_MODES, MODEL, Envoy, Epp, Response, Rig, Sim, marker

pytestmark = pytest.mark.integration

WITH_FALLBACK = {
    "plugins": [
        {"type": "openai-parser"},
        {"name": "anthropic", "type": "anthropic-parser"},
        {"name": "fallback", "type": "passthrough-parser"},
    ],
    "requestHandler": {
        "parsers": [{"pluginRef": "openai-parser"}, {"pluginRef": "anthropic"}, {"pluginRef": "fallback"}]
    },
}
WITHOUT_FALLBACK = {
    "plugins": [{"type": "openai-parser"}, {"type": "anthropic-parser"}],
    "requestHandler": {"parsers": [{"pluginRef": "openai-parser"}, {"pluginRef": "anthropic-parser"}]},
}
ANTHROPIC_MODEL = MODEL  # a served model keeps its own metric label


@dataclass
class Pool:
    sims: list[Sim]
    epp: Epp
    envoys: dict[str, Envoy]
    strict: Envoy  # in front of the EPP without a fallback parser


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    rig = Rig(Path(tmp_path_factory.mktemp("parsers")) / "logs")
    try:
        sims = rig.start_sims(2, prefix="parsers")
        epp = rig.start_epp(sims, name="epp-parsers", config=WITH_FALLBACK)
        envoys = {
            mode: rig.start_envoy(epp, body_mode=mode, name=f"envoy-parsers-{mode.lower()}")
            for mode in BODY_MODES
        }
        strict_epp = rig.start_epp(sims, name="epp-parsers-strict", config=WITHOUT_FALLBACK)
        strict = rig.start_envoy(strict_epp, name="envoy-parsers-strict")
        yield Pool(sims, epp, envoys, strict)
    finally:
        rig.close()


def _landed(pool: Pool, resp: Response, text: str, sent: bytes, path: str) -> None:
    """The answering sim journaled the request, at the destination the EPP chose, unchanged."""
    sim = next((s for s in pool.sims if s.port == resp.port), None)
    assert sim is not None, f"answered by no pool sim: {resp}"
    entry = sim.find(text)
    assert entry is not None, f"{sim.name} has no journal entry for {text}"
    assert entry["path"] == path
    assert entry["headers"].get("x-gateway-destination-endpoint") == sim.address
    assert entry["body"].encode() == sent
    for other in pool.sims:
        if other is not sim:
            assert other.find(text) is None


def _requests_for_model(epp: Epp, model: str) -> float:
    """The EPP's ``inference_objective_request_total`` summed over the series of ``model``."""
    total = 0.0
    for line in epp.metrics().splitlines():
        if line.startswith("inference_objective_request_total{") and f'model_name="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _error(resp: Response) -> str:
    message = resp.json()["error"]["message"]
    assert isinstance(message, str)
    return message


def _messages_body(text: str, **extra: object) -> bytes:
    body = {
        "model": ANTHROPIC_MODEL,
        "max_tokens": 64,
        "system": [{"type": "text", "text": "You are a routing test."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": f"{text} hello"}]}],
        **extra,
    }
    return json.dumps(body).encode()


@pytest.mark.parametrize("mode", BODY_MODES)
def test_anthropic_messages_are_parsed_and_routed(pool: Pool, mode: str) -> None:
    m = marker()
    sent = _messages_body(m)
    before = _requests_for_model(pool.epp, ANTHROPIC_MODEL)
    path = "/v1/messages?beta=true"  # the query string is stripped before the parser match
    resp = pool.envoys[mode].post(path, sent, {"content-type": "application/json"})
    assert resp.status == 404, resp  # the sim does not serve it: it was routed there
    _landed(pool, resp, m, sent, path)
    deadline = time.monotonic() + 10
    while _requests_for_model(pool.epp, ANTHROPIC_MODEL) < before + 1:  # the body's model was read
        assert time.monotonic() < deadline, "the anthropic parser's model never reached the EPP's metrics"
        time.sleep(0.1)


@pytest.mark.parametrize("mode", BODY_MODES)
def test_bad_anthropic_body_is_a_400_from_the_epp(pool: Pool, mode: str) -> None:
    m = marker()
    resp = pool.envoys[mode].post("/v1/messages", json.dumps({"model": m, "messages": []}).encode())
    assert resp.status == 400, resp
    assert "invalid messages request: must have at least one message" in _error(resp)
    assert all(s.find(m) is None for s in pool.sims)


@pytest.mark.parametrize("mode", BODY_MODES)
def test_unclaimed_path_is_forwarded_by_the_passthrough_fallback(pool: Pool, mode: str) -> None:
    m = marker()
    sent = f"query={m}&documents=a,b,c".encode()  # not JSON, no model: never parsed
    resp = pool.envoys[mode].post("/v1/rerank", sent, {"content-type": "application/x-www-form-urlencoded"})
    assert resp.status == 404, resp
    _landed(pool, resp, m, sent, "/v1/rerank")


def test_unclaimed_path_without_fallback_is_a_400_naming_it(pool: Pool) -> None:
    m = marker()
    resp = pool.strict.post("/v1/rerank?x=1", json.dumps({"model": "demo", "query": m}).encode())
    assert resp.status == 400, resp
    assert "no parser registered matching path suffix for: /v1/rerank" in _error(resp)
    assert all(s.find(m) is None for s in pool.sims)
    # the claimed paths still work behind the same EPP
    m = marker()
    sent = _messages_body(m)
    resp = pool.strict.post("/v1/messages", sent)
    assert resp.status == 404, resp
    _landed(pool, resp, m, sent, "/v1/messages")
