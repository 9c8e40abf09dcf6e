"""Fixtures shared by the unit tests that talk to the in-process fake Kubernetes API server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from epp.k8s.client import api_client
from tests.fakekube import FakeKube


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    """A fake API server (bookmarks every 0.2 s); a test module may define its own."""
    with FakeKube(bookmark_interval=0.2) as k:
        yield k


@pytest.fixture
async def api(kube: FakeKube, tmp_path: Path) -> AsyncIterator[client.ApiClient]:
    """The real Kubernetes client, configured for ``kube``."""
    c = await api_client(str(kube.write_kubeconfig(tmp_path / "kubeconfig")))
    yield c
    await c.close()
