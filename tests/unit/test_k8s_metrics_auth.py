"""``--metrics-endpoint-auth``: the real metrics HTTP server behind TokenReview and
SubjectAccessReview, against the fake API server: 401 without or with an unknown token, 403 for a
user not allowed ``get`` on ``/metrics``, the metrics for an allowed one, cached answers, and 500
(not cached) when the API server fails."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
from kubernetes_asyncio import client

from epp.dev.stack import free_port
from epp.k8s.metrics_auth import MetricsAuth
from epp.promlite import start_http_server
from tests.fakekube import FakeKube

PROMETHEUS = "prometheus-token"
OTHER = "someone-else-token"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as k:
        k.add_user(PROMETHEUS, "system:serviceaccount:monitoring:prometheus", ("system:serviceaccounts",))
        k.add_user(OTHER, "system:serviceaccount:default:other")
        k.grant_non_resource("system:serviceaccount:monitoring:prometheus", "get", "/metrics")
        yield k


@pytest.fixture
async def metrics_url(api: client.ApiClient) -> AsyncIterator[str]:
    port = free_port()
    auth = MetricsAuth(api, asyncio.get_running_loop())
    httpd, thread = start_http_server(port, addr="127.0.0.1", middleware=auth.wrap)
    yield f"http://127.0.0.1:{port}/metrics"
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def scrape(url: str, token: str | None) -> tuple[int, bytes]:
    return await asyncio.to_thread(_get, url, token)  # the event loop stays free for the reviews


async def test_only_an_authorized_token_gets_the_metrics(kube: FakeKube, metrics_url: str) -> None:
    assert (await scrape(metrics_url, None))[0] == 401
    assert kube.reviews == []  # no token: refused without asking the API server
    assert (await scrape(metrics_url, "forged"))[0] == 401
    assert kube.reviews == ["token"]
    assert (await scrape(metrics_url, OTHER))[0] == 403
    assert kube.reviews == ["token", "token", "access"]
    status, body = await scrape(metrics_url, PROMETHEUS)
    assert status == 200 and b"# TYPE" in body
    # answers are cached: no new reviews for the same tokens
    reviews = len(kube.reviews)
    assert (await scrape(metrics_url, PROMETHEUS))[0] == 200
    assert (await scrape(metrics_url, OTHER))[0] == 403
    assert len(kube.reviews) == reviews
    # each path is reviewed on its own: only /metrics is granted
    assert (await scrape(metrics_url.replace("/metrics", "/other"), PROMETHEUS))[0] == 403


async def test_an_api_server_failure_is_500_and_not_cached(kube: FakeKube, metrics_url: str) -> None:
    kube.fail_next("POST", "tokenreviews", 500)
    assert (await scrape(metrics_url, PROMETHEUS))[0] == 500
    assert (await scrape(metrics_url, PROMETHEUS))[0] == 200
