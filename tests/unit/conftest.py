"""Fixtures shared by the unit tests: the in-process fake Kubernetes API server; logging and /metrics
exposition put back after each test (an in-process ``epp`` command or ``EppServer`` changes them)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog
from kubernetes_asyncio import client

from epp import promlite
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


@pytest.fixture(autouse=True)
def _isolated_logging_and_exposition() -> Iterator[None]:
    """structlog, the root logger and /metrics as they were before the test (every family shown,
    deprecated twins included), whatever an in-process command configured or a server loaded."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)
    promlite.configure_exposition()
