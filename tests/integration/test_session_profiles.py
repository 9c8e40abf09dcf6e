"""A request header chooses the scheduling profile, and a session id keeps a session on one endpoint.

Through real Envoy and the real EPP: ``header-profile-handler`` runs the profile named by ``x-profile``
(``a`` without it, 400 for an unknown one); ``session-affinity-scorer`` with ``strategy: session_id``
binds each ``x-session-id`` to the endpoint that served its first request.
"""

from __future__ import annotations

import pytest
import yaml

from tests.integration.harness import Rig, chat_body, marker

pytestmark = pytest.mark.integration

CONFIG = yaml.safe_load(
    """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: header-profile-handler, parameters: {headerName: X-Profile, defaultProfile: a}}
- {name: group-a, type: label-selector-filter, parameters: {matchLabels: {group: a}}}
- {name: group-b, type: label-selector-filter, parameters: {matchLabels: {group: b}}}
- type: session-affinity-scorer
  parameters: {strategy: session_id, sessionIdConfig: {sources: [{header: x-session-id}]}}
- {type: max-score-picker}
schedulingProfiles:
- name: a
  plugins:
  - {pluginRef: group-a}
  - {pluginRef: session-affinity-scorer, weight: 10}
  - {pluginRef: max-score-picker}
- name: b
  plugins:
  - {pluginRef: group-b}
  - {pluginRef: session-affinity-scorer, weight: 10}
  - {pluginRef: max-score-picker}
"""
)


def test_header_chooses_profile_and_session_id_pins_endpoint(rig: Rig) -> None:
    sims = rig.start_sims(4)
    labels = {s.name: {"group": "a" if i < 2 else "b"} for i, s in enumerate(sims)}
    group = {s.port: labels[s.name]["group"] for s in sims}
    epp = rig.start_epp(sims, config=CONFIG, labels=labels)
    envoy = rig.start_envoy(epp)

    # The header names the profile; without it the default profile runs.
    for headers, expected in (({"x-profile": "b"}, "b"), ({}, "a"), ({"X-Profile": "a"}, "a")):
        for _ in range(4):
            resp = envoy.post("/v1/chat/completions", chat_body(marker()), headers)
            assert resp.status == 200, resp
            assert resp.port is not None and group[resp.port] == expected, (headers, resp.port)

    # An unknown profile name is the client's error.
    resp = envoy.post("/v1/chat/completions", chat_body(marker()), {"x-profile": "nope"})
    assert resp.status == 400, resp
    assert "nope" in resp.json()["error"]["message"]

    # Consecutive requests of one session land on one endpoint (within the chosen profile's group).
    served: dict[str, set[int]] = {}
    for round_ in range(6):
        for session in ("s-1", "s-2", "s-3", "s-4"):
            resp = envoy.post(
                "/v1/chat/completions", chat_body(marker()), {"x-session-id": session, "x-profile": "b"}
            )
            assert resp.status == 200, (round_, session, resp)
            assert resp.port is not None and group[resp.port] == "b"
            served.setdefault(session, set()).add(resp.port)
    assert all(len(ports) == 1 for ports in served.values()), served
