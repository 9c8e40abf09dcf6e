"""Fixtures of the integration tests (the harness itself is ``tests/integration/harness.py``).

* ``rig`` — an empty :class:`Rig` for tests that need their own processes (stopping the EPP,
  rewriting the endpoints file, an empty pool);
* ``shared`` — one session-wide pool: 3 registered sims, 1 unregistered "rogue" sim, one EPP and one
  Envoy per body mode (both with the subset-hint header ``x-test-endpoint-subset``);
* ``envoy`` — parametrized over the body modes: the shared pool's Envoy for that mode (the sims'
  request journals are cleared first).

When a test fails, the last lines of every live process's log are attached to its report
("process logs" section).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    BODY_MODES,
    SUBSET_HEADER,
    Envoy,
    Rig,
    Shared,
    active_rig_logs,
    require_envoy,
)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    require_envoy()
    r = Rig(tmp_path / "logs")
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    require_envoy()
    r = Rig(tmp_path_factory.mktemp("shared") / "logs")
    try:
        sims = r.start_sims(3)
        (rogue,) = r.start_sims(1, prefix="rogue")
        epp = r.start_epp(sims)
        envoys = {
            mode: r.start_envoy(epp, body_mode=mode, subset_hint_header=SUBSET_HEADER) for mode in BODY_MODES
        }
        yield Shared(r, sims, rogue, epp, envoys)
    finally:
        r.close()


@pytest.fixture(params=BODY_MODES)
def envoy(request: pytest.FixtureRequest, shared: Shared) -> Envoy:
    for sim in [*shared.sims, shared.rogue]:
        sim.clear()
    return shared.envoys[request.param]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.failed and report.when in ("setup", "call"):
        text = active_rig_logs()
        if text:
            report.sections.append(("process logs (last lines)", text))
    return report
