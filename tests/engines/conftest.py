"""Fixtures of the engine tests: one session-wide pool of real vLLM engines (see ``harness``) and,
per test, an EPP and a real Envoy in front of it (:func:`front`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.dev.stack import engines as eng
from tests.engines.harness import Pool, engine_pool, external_pool
from tests.integration.conftest import pytest_runtest_makereport as pytest_runtest_makereport
from tests.integration.harness import Rig, require_envoy


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    external = external_pool()
    if external is not None:
        yield external
        return
    why = eng.missing()
    if why:
        if os.environ.get("EPP_ENGINE_TESTS_REQUIRED"):
            pytest.fail(f"engines required but unavailable: {why}")
        pytest.skip(why)
    p = engine_pool(tmp_path_factory.mktemp("engines"))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    require_envoy()
    r = Rig(tmp_path / "logs")
    try:
        yield r
    finally:
        r.close()


# run first, on engines that have served nothing yet (it needs an engine life of one batch)
FIRST = "test_killed_engine_restarted_loses_its_old_blocks_and_keeps_its_first_batch"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Engine tests wait for engines to start (a minute or two on 2 busy cores): a longer timeout;
    :data:`FIRST` first."""
    for item in items:
        if "tests/engines/" in str(item.fspath) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))
    items.sort(key=lambda item: item.name != FIRST)
