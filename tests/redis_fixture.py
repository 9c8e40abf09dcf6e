"""A private ``redis-server`` for the tests (``redis_server`` fixture): started on a free port for
the test that asks, stopped after it. Missing binary: a failure under CI (``CI=true``, where the
Debian package ``redis-server`` is required), else a skip saying why."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.dev.stack.redis_server import DEBIAN_PACKAGE, RedisServer, redis_server_binary


def require_redis_server() -> None:
    if redis_server_binary() is not None:
        return
    message = (
        f"redis-server is not on PATH: install the Debian package {DEBIAN_PACKAGE} "
        f"(apt-get install {DEBIAN_PACKAGE}) to run the cross-replica tests"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis_server()
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()
