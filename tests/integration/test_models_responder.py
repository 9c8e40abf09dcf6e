"""``models-responder`` through the real Envoy, EPP and sims: ``GET /v1/models`` is answered by the
EPP with the union of the pool's models and LoRA adapters (each sim lists only its own), without
reaching a model server; inference requests still route."""

from __future__ import annotations

import time

from tests.integration.harness import JSON_HEADERS, MODEL, Rig, chat_body, marker

WAIT_S = 30.0

CONFIG: dict[str, object] = {
    "plugins": [
        {"type": "models-responder"},
        {"type": "queue-scorer"},
        {"type": "max-score-picker"},
        {"type": "single-profile-handler"},
    ],
    "schedulingProfiles": [
        {"name": "default", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]}
    ],
}


def test_get_models_is_answered_by_the_epp_with_the_pool_union(rig: Rig) -> None:
    (sql,) = rig.start_sims(1, extra=["--lora-modules", "sql-lora"])
    (law,) = rig.start_sims(1, extra=["--lora-modules", "law-lora"])
    epp = rig.start_epp([sql, law], config=CONFIG, extra=["--allow-experimental-plugins"])
    envoy = rig.start_envoy(epp)
    want = sorted([MODEL, "law-lora", "sql-lora"])
    deadline = time.monotonic() + WAIT_S
    while True:
        resp = envoy.get("/v1/models?limit=5")
        ids = sorted(m["id"] for m in resp.json()["data"]) if resp.status == 200 else []
        if ids == want or time.monotonic() > deadline:
            break
        assert resp.status in (200, 503), resp  # 503 until both endpoints were polled once
        time.sleep(0.1)
    assert ids == want, resp
    assert resp.headers["content-type"] == "application/json"
    assert "x-inference-port" not in resp.headers  # no model server answered
    assert envoy.get("/v1/models/").status == 200  # a trailing slash matches too
    routed = envoy.post("/v1/chat/completions", chat_body(marker()), JSON_HEADERS)
    assert routed.status == 200, routed
    other = envoy.get("/health")  # other bodyless requests still go to an endpoint
    assert other.port in (sql.port, law.port), other
