"""Command lines of the local stack's children: ``epp sim``, ``epp serve`` and Envoy.

Envoy's command line is :func:`epp.dev.envoy.command.envoy_argv` (re-exported here).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence

from epp.dev.envoy.command import envoy_argv as envoy_argv


def epp_socket(grpc_port: int) -> str:
    """The Unix socket a local EPP serving ``grpc_port`` also listens on (``--grpc-socket``) for its
    Envoy: short (a socket path has at most 107 bytes) and unique while the port is taken."""
    return os.path.join(tempfile.gettempdir(), f"epp-{grpc_port}.sock")


def python_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "epp", *args]


def sim_argv(port: int, name: str, model: str = "demo", extra: Sequence[str] = ()) -> list[str]:
    return python_argv("sim", "--port", str(port), "--model", model, "--name", name, *extra)


def serve_argv(
    *,
    grpc_port: int,
    health_port: int,
    metrics_port: int,
    config_text: str,
    extra: Sequence[str] = (),
    config_file: str = "",
) -> list[str]:
    """``epp serve`` with ``config_text`` (or, when ``config_file`` is given, that file)."""
    config = ["--config-file", config_file] if config_file else ["--config-text", config_text]
    return python_argv(
        "serve",
        "--bind-address=127.0.0.1",  # a local stack listens on loopback only (serve's default is 0.0.0.0)
        "--secure-serving=false",
        f"--grpc-port={grpc_port}",
        f"--grpc-health-port={health_port}",
        f"--metrics-port={metrics_port}",
        *config,
        *extra,
    )
