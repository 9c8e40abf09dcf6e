"""Scheduling by request headers and endpoint locality: header-chosen profiles, session ids, topology.

Through real Envoy and the real EPP: ``header-profile-handler`` runs the profile named by ``x-profile``
(``a`` without it, 400 for an unknown one); ``session-affinity-scorer`` with ``strategy: session_id``
binds each ``x-session-id`` to the endpoint that served its first request; ``topology-extractor``
with ``topology-affinity-scorer`` puts the prefill stage on the decode endpoint's host, following
label changes.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import yaml

from tests.integration.harness import Rig, chat_body, marker

pytestmark = pytest.mark.integration


@functools.cache
def alpha_flags() -> tuple[str, ...]:
    """``--allow-experimental-plugins`` when this build has the flag (the types here are alpha)."""
    out = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    return ("--allow-experimental-plugins",) if "--allow-experimental-plugins" in out.stdout else ()


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
    epp = rig.start_epp(sims, config=CONFIG, labels=labels, extra=alpha_flags())
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


TOPOLOGY_CONFIG = yaml.safe_load(
    """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: always-disagg-pd-decider}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always-disagg-pd-decider}}}
- {type: topology-extractor}
- {type: topology-affinity-scorer}
- {type: prefill-filter}
- {type: decode-filter}
- {type: max-score-picker}
schedulingProfiles:
- name: prefill
  plugins:
  - {pluginRef: prefill-filter}
  - {pluginRef: topology-affinity-scorer, weight: 1}
  - {pluginRef: max-score-picker}
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
"""
)


def test_prefill_is_picked_on_the_decode_endpoints_host(rig: Rig) -> None:
    decode, far, near = rig.start_sims(3)
    host = "kubernetes.io/hostname"
    labels = {
        decode.name: {"llm-d.ai/role": "decode", host: "node-1"},
        far.name: {"llm-d.ai/role": "prefill", host: "node-2"},
        near.name: {"llm-d.ai/role": "prefill", host: "node-1"},
    }
    epp = rig.start_epp([decode, far, near], config=TOPOLOGY_CONFIG, labels=labels, extra=alpha_flags())
    envoy = rig.start_envoy(epp)
    for _ in range(6):
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m))
        assert resp.status == 200, resp
        entry = decode.find(m)
        assert entry is not None
        assert entry["headers"].get("x-prefiller-host-port") == near.address

    # the labels change: the other prefill endpoint is now on the decode endpoint's host
    moved = {
        **labels,
        far.name: {**labels[far.name], host: "node-1"},
        near.name: {**labels[near.name], host: "node-3"},
    }
    epp.set_endpoints_with_labels([decode, far, near], moved)

    def prefill_for_new_request() -> str | None:
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m))
        entry = decode.find(m) if resp.status == 200 else None
        return entry["headers"].get("x-prefiller-host-port") if entry else None

    rig.stack.wait("prefill follows the relabelled host", lambda: prefill_for_new_request() == far.address)
    for _ in range(4):
        assert prefill_for_new_request() == far.address
