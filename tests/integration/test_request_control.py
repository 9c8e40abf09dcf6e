"""Request-control plugins end to end: real Envoy, the real ``epp serve`` and simulated vLLM servers.

* ``request-attribute-reporter``: the usage-derived value reaches Envoy as ``envoy.lb`` dynamic
  metadata, read back through an Envoy access log (``%DYNAMIC_METADATA(...)%``), for a JSON and an
  event-stream response;
* ``disaggregatedset-rollout-screener`` (alpha): labelled endpoints from file discovery; only a
  revision with every required role gets traffic, a strict header pins one, the serving endpoint's
  revision comes back as a response header;
* ``probabilistic-admitter``: in Kubernetes mode (fake API server) a request naming a sheddable
  InferenceObjective is rejected with 429 and the dropped-reason header while the pool is saturated
  (metrics never scraped), and a request without one is served.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from tests.fakekube import FakeKube, objects
from tests.integration.harness import Envoy, Epp, Rig, chat_body, marker

pytestmark = pytest.mark.integration

COST_KEY = "x-gateway-inference-request-cost"
REPORTER = {
    "plugins": [
        {
            "name": "cost",
            "type": "request-attribute-reporter",
            "parameters": {
                "attributes": [
                    {
                        "key": {"namespace": "envoy.lb", "name": COST_KEY},
                        "expression": "usage.prompt_tokens + usage.completion_tokens",
                        "condition": "has(usage.prompt_tokens) && has(usage.completion_tokens)",
                    }
                ]
            },
        }
    ]
}


def _envoy_with_access_log(rig: Rig, epp: Epp, log_path: Path) -> Envoy:
    """Envoy in FULL_DUPLEX_STREAMED for request and response bodies, logging the cost metadata."""
    port, admin_port = stack.free_port(), stack.free_port()
    config: dict[str, Any] = envoy_config.envoy_bootstrap(
        listen_port=port,
        admin_port=admin_port,
        extproc_port=epp.grpc_port,
        body_mode="FULL_DUPLEX_STREAMED",
        response_body_mode="FULL_DUPLEX_STREAMED",
        fail_open=False,
        extproc_health_port=0,
    )
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(log_path),
                "log_format": {
                    "json_format": {
                        "request_id": "%REQ(X-TEST-ID)%",
                        "cost": f"%DYNAMIC_METADATA(envoy.lb:{COST_KEY})%",
                        "status": "%RESPONSE_CODE%",
                    }
                },
            },
        }
    ]
    child = rig.stack.start_envoy("envoy-reporter", config, log_level="warning", concurrency=1)
    envoy = Envoy(child, port, admin_port, "FULL_DUPLEX_STREAMED", False)
    rig.stack.wait_envoy(child, admin_port)
    return envoy


def _logged(log_path: Path, request_id: str, timeout: float = 20.0) -> dict[str, Any]:
    """The access-log entry of ``request_id`` (Envoy writes it when the stream ends; flushed ~1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log_path.exists():
            for line in log_path.read_text().splitlines():
                entry = json.loads(line)
                if entry.get("request_id") == request_id:
                    return dict(entry)
        time.sleep(0.2)
    raise AssertionError(f"no access-log entry for {request_id} in {timeout} s")


def _sse_usage(body: bytes) -> dict[str, Any]:
    for line in body.decode().splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            event = json.loads(line[6:])
            if event.get("usage"):
                return dict(event["usage"])
    raise AssertionError("no usage event in the stream")


def test_request_attribute_reporter_metadata_reaches_envoy(rig: Rig, tmp_path: Path) -> None:
    sims = rig.start_sims(1)
    epp = rig.start_epp(sims, config=REPORTER)
    log_path = tmp_path / "access.log"
    envoy = _envoy_with_access_log(rig, epp, log_path)
    rig.stack.wait(
        "a chat completion through envoy-reporter",
        lambda: envoy.post("/v1/chat/completions", chat_body(marker())).status == 200,
        children=[envoy.child, epp.child],
    )

    rid = f"json-{marker()}"
    resp = envoy.post("/v1/chat/completions", chat_body(marker()), headers={"x-test-id": rid})
    assert resp.status == 200, resp.body[:300]
    usage = resp.json()["usage"]
    expected = usage["prompt_tokens"] + usage["completion_tokens"]
    assert expected > 0
    assert _logged(log_path, rid)["cost"] == expected

    rid = f"sse-{marker()}"
    resp = envoy.post(
        "/v1/chat/completions",
        json.dumps(
            {**json.loads(chat_body(marker(), stream=True)), "stream_options": {"include_usage": True}}
        ).encode(),
        headers={"x-test-id": rid},
    )
    assert resp.status == 200, resp.body[:300]
    usage = _sse_usage(resp.body)
    assert _logged(log_path, rid)["cost"] == usage["prompt_tokens"] + usage["completion_tokens"]


# --- disaggregatedset-rollout-screener -----------------------------------------------------------

REV, ROLE, SET = (
    "disaggregatedset.x-k8s.io/revision",
    "disaggregatedset.x-k8s.io/role",
    "disaggregatedset.x-k8s.io/name",
)
SCREENER = {
    "plugins": [
        {
            "name": "rollout",
            "type": "disaggregatedset-rollout-screener",
            "parameters": {
                "scope": {"labelSelector": f"{SET}=my-set"},
                "headerSelectors": [
                    {"name": "revision", "headerName": "x-disagg-revision", "labelKey": REV, "mode": "strict"}
                ],
                "revisionGating": {"mode": "max-role", "requireRoles": {"values": ["prefill", "decode"]}},
            },
        }
    ]
}


def _labels(revision: str, role: str) -> dict[str, str]:
    return {REV: revision, ROLE: role, SET: "my-set"}


def test_rollout_screener_keeps_requests_on_complete_revisions(rig: Rig) -> None:
    sims = rig.start_sims(5)
    shape = [("A", "prefill"), ("A", "decode"), ("B", "decode"), ("B", "decode")]
    labels = {s.name: _labels(*rs) for s, rs in zip(sims, shape, strict=False)}
    epp = rig.start_epp(sims[:4], config=SCREENER, labels=labels, extra=["--allow-experimental-plugins"])
    envoy = rig.start_envoy(epp)
    names_a = {sims[0].name, sims[1].name}

    for _ in range(8):  # B has no prefill pod: every request stays on A
        resp = envoy.post("/v1/chat/completions", chat_body(marker()))
        assert resp.status == 200, resp.body[:300]
        assert resp.headers["x-inference-pod"] in names_a
        assert resp.headers["x-disagg-revision"] == "A"
    resp = envoy.post("/v1/chat/completions", chat_body(marker()), headers={"x-disagg-revision": "B"})
    assert resp.status == 503, resp.body[:300]
    assert "screeners eliminated all endpoint candidates" in resp.json()["error"]["message"]

    labels[sims[4].name] = _labels("B", "prefill")  # B gets its prefill pod: now covered
    epp.set_endpoints_with_labels(sims, labels)

    def b_pinned() -> bool:
        r = envoy.post("/v1/chat/completions", chat_body(marker()), headers={"x-disagg-revision": "B"})
        return r.status == 200 and r.headers.get("x-disagg-revision") == "B"

    rig.stack.wait("revision B to be covered", b_pinned, children=[envoy.child, epp.child])
    seen = set()
    for _ in range(30):  # decode dominates (A 1, B 2): about a third of the requests stay on A
        resp = envoy.post("/v1/chat/completions", chat_body(marker()))
        assert resp.status == 200, resp.body[:300]
        seen.add(resp.headers["x-disagg-revision"])
    assert seen == {"A", "B"}


# --- probabilistic-admitter (Kubernetes mode: objectives give priorities) ------------------------

NS = "inference"
HOSTS = ["127.0.0.21"]


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=0.5) as k:
        yield k


def test_probabilistic_admitter_rejects_sheddable_requests_with_429(
    rig: Rig, kube: FakeKube, tmp_path: Path
) -> None:
    port = stack.free_port()
    (sim,) = rig.start_sims(1, prefix="pod", hosts=HOSTS, port=port)
    kube.create(objects.inference_pool(NS, (port,)))
    kube.create(objects.pod(NS, sim.name, sim.host, ready=True))
    kube.create(objects.objective(NS, "batch", -1))
    config = {
        "plugins": [
            {"type": "probabilistic-admitter"},
            # the pool's metrics are never scraped: every endpoint counts as saturated (p = 1)
            {"type": "metrics-data-source", "parameters": {"path": "/no-such-metrics"}},
            # the legacy gate ignores unscraped endpoints, so the admitter alone sheds
            {"type": "utilization-detector", "parameters": {"stalenessPolicy": "ignore"}},
        ],
        "dataLayer": {"sources": [{"pluginRef": "metrics-data-source"}]},
    }
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    epp = rig.start_epp(
        [],
        file_discovery=False,
        config=config,
        extra=["--pool-namespace", NS, "--kubeconfig", str(kubeconfig), "--pool-name", "pool"],
    )
    envoy = rig.start_envoy(epp)

    def objective_known() -> bool:
        resp = envoy.post(
            "/v1/chat/completions", chat_body(marker()), headers={"x-gateway-inference-objective": "batch"}
        )
        return resp.status == 429

    rig.stack.wait("the sheddable objective to be shed", objective_known, children=[envoy.child, epp.child])
    for _ in range(5):
        resp = envoy.post(
            "/v1/chat/completions", chat_body(marker()), headers={"x-gateway-inference-objective": "batch"}
        )
        assert resp.status == 429, resp.body[:300]
        assert resp.headers.get("x-llm-d-request-dropped-reason") == "rejected-saturated"
        message = resp.json()["error"]["message"]
        assert message.startswith("inference error: ResourceExhausted - probabilistic-admitter: rejected")
    for _ in range(3):  # priority 0: always admitted
        resp = envoy.post("/v1/chat/completions", chat_body(marker()))
        assert resp.status == 200, resp.body[:300]
