"""Prefill/decode disaggregation end to end: the profile handler's decision reaches the model server.

Decode endpoints receive ``x-prefiller-host-port`` naming a prefill endpoint; with no prefill
endpoint left the request is served decode-only (no header, still 200); with no decode endpoint the
request fails with 429 (scheduling could not place it).
"""

from __future__ import annotations

import pytest
import yaml

from tests.integration.harness import BODY_MODES, Rig, chat_body, marker

pytestmark = pytest.mark.integration

PD_CONFIG = yaml.safe_load(
    """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: always-disagg-pd-decider}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always-disagg-pd-decider}}}
- {type: prefill-filter}
- {type: decode-filter}
- {type: queue-scorer}
schedulingProfiles:
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}]}
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: queue-scorer}]}
"""
)
ROLE = "llm-d.ai/role"
PREFILL_HEADER = "x-prefiller-host-port"


@pytest.mark.parametrize("mode", BODY_MODES)
def test_prefill_decode_then_decode_only_then_no_decode(rig: Rig, mode: str) -> None:
    prefill, decode_a, decode_b = rig.start_sims(3)
    labels = {
        prefill.name: {ROLE: "prefill"},
        decode_a.name: {ROLE: "decode"},
        decode_b.name: {ROLE: "decode"},
    }
    epp = rig.start_epp([prefill, decode_a, decode_b], config=PD_CONFIG, labels=labels)
    envoy = rig.start_envoy(epp, body_mode=mode)
    decoders = {decode_a.port: decode_a, decode_b.port: decode_b}

    # 1. P/D: the decode endpoint serves, told which prefill endpoint to use.
    for _ in range(6):
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m), {PREFILL_HEADER: "6.6.6.6:1"})
        assert resp.status == 200, resp
        assert resp.port in decoders, "the destination is the decode endpoint"
        entry = decoders[resp.port].find(m)
        assert entry is not None
        assert entry["headers"].get(PREFILL_HEADER) == prefill.address
    assert prefill.journal() == []  # the decode side (its sidecar) calls the prefiller, not Envoy

    # 2. The prefill endpoint leaves the pool: the prefill profile fails -> decode-only, still served.
    epp.set_endpoints_with_labels([decode_a, decode_b], labels)
    served_without_prefill = False
    for _ in range(200):
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m))
        assert resp.status == 200, resp
        entry = decoders[resp.port].find(m)
        assert entry is not None
        if PREFILL_HEADER not in entry["headers"]:
            served_without_prefill = True
            break
    assert served_without_prefill, "the removed prefill endpoint was still used"
    for _ in range(10):  # from then on, every request is decode-only
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m))
        assert resp.status == 200, resp
        entry = decoders[resp.port].find(m)
        assert entry is not None and PREFILL_HEADER not in entry["headers"]

    # 3. Only a prefill endpoint: the decode profile fails -> the request fails (429).
    epp.set_endpoints_with_labels([prefill], labels)
    status = 0
    for _ in range(200):
        status = envoy.post("/v1/chat/completions", chat_body(marker())).status
        if status == 429:
            break
    assert status == 429
    resp = envoy.post("/v1/chat/completions", chat_body(marker()))
    assert resp.status == 429
    # as the reference since its #2462: the decode filter drained a non-empty pool, so the typed
    # "no endpoints" error of the profile run is answered (not the handler's), reason saturated
    message = resp.json()["error"]["message"]
    assert "no endpoints available for the given request (filter 'decode-filter')" in message
    assert resp.headers.get("x-llm-d-request-dropped-reason") == "rejected-saturated"
