"""The subset hint confines routing.

Envoy copies the request header into ``envoy.lb.subset_hint`` metadata, which it forwards to the EPP.
"""

from __future__ import annotations

import pytest

from tests.integration.harness import SUBSET_HEADER, Envoy, Shared, chat_body, marker

pytestmark = pytest.mark.integration

REQUESTS = 30


def test_one_hinted_endpoint_gets_every_request(shared: Shared, envoy: Envoy) -> None:
    target = shared.sims[1]
    for _ in range(REQUESTS):
        m = marker()
        resp = envoy.post("/v1/chat/completions", chat_body(m), {SUBSET_HEADER: target.address})
        assert resp.status == 200, resp
        assert resp.port == target.port
        entry = target.find(m)
        assert entry is not None
        assert entry["headers"]["x-gateway-destination-endpoint"] == target.address
        assert SUBSET_HEADER not in entry["headers"]


def test_two_hinted_endpoints_share_the_requests(shared: Shared, envoy: Envoy) -> None:
    allowed = {shared.sims[0].port, shared.sims[2].port}
    hint = f"{shared.sims[0].address},{shared.sims[2].address}"
    for _ in range(REQUESTS):
        resp = envoy.post(
            "/v1/completions", f'{{"model":"demo","prompt":"{marker()}"}}'.encode(), {SUBSET_HEADER: hint}
        )
        assert resp.status == 200, resp
        assert resp.port in allowed
    assert shared.sims[1].journal() == []


def test_hint_without_any_pool_endpoint_is_a_503(shared: Shared, envoy: Envoy) -> None:
    resp = envoy.post("/v1/chat/completions", chat_body(marker()), {SUBSET_HEADER: shared.rogue.address})
    assert resp.status == 503, resp
    assert "ServiceUnavailable" in resp.json()["error"]["message"]
    assert shared.rogue.journal() == []


def test_no_hint_means_every_endpoint_is_a_candidate(shared: Shared, envoy: Envoy) -> None:
    seen: set[int | None] = set()
    # The default profile spreads new prompts by each endpoint's recent new prompts, hinted ones
    # included: after the hinted tests above (60 to sims[1], 30 to each other), the other two
    # catch up first (60 requests), then every endpoint takes its turn.
    for _ in range(200):
        resp = envoy.post("/v1/chat/completions", chat_body(marker()))
        assert resp.status == 200, resp
        seen.add(resp.port)
        if len(seen) == len(shared.sims):
            break
    assert seen == {s.port for s in shared.sims}
