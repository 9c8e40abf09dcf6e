"""Command lines of the local stack's children: ``epp sim``, ``epp serve`` and Envoy.

Envoy's command line is :func:`epp.dev.envoy.command.envoy_argv` (re-exported here).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from epp.dev.envoy.command import envoy_argv as envoy_argv

# AF_UNIX's sun_path holds 108 bytes including the terminating NUL (Linux).
SOCKET_PATH_MAX = 107


def epp_socket(grpc_port: int, directory: str | Path = "") -> str:
    """The Unix socket a local EPP serving ``grpc_port`` also listens on (``--grpc-socket``) for its
    Envoy: ``directory/epp-<grpc_port>.sock`` (a stack's work directory, removed with it), or in the
    temporary directory when ``directory`` is "" or too long for a socket path (at most
    :data:`SOCKET_PATH_MAX` bytes); unique while the port is taken.

    Raises ValueError when even the temporary directory's path is too long.
    """
    name = f"epp-{grpc_port}.sock"
    if directory:
        path = os.path.join(os.fspath(directory), name)
        if _fits(path):
            return path
    path = os.path.join(tempfile.gettempdir(), name)
    if not _fits(path):
        raise ValueError(
            f"the EPP's Unix socket {path} is {len(os.fsencode(path))} bytes, over the "
            f"{SOCKET_PATH_MAX}-byte limit of a socket path: set TMPDIR to a shorter directory"
        )
    return path


def _fits(path: str) -> bool:
    return len(os.fsencode(path)) <= SOCKET_PATH_MAX


def python_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "epp", *args]


# Every stack's simulator runs as the docs tell users to start vLLM: render and token-in endpoints
# on (token-producer, P/D), cached prompt tokens reported (llm_d_epp_request_cached_tokens).
SIM_VLLM_FLAGS = ("--enable-scale-out", "--enable-prompt-tokens-details")


def sim_argv(port: int, name: str, model: str = "demo", extra: Sequence[str] = ()) -> list[str]:
    return python_argv("sim", "--port", str(port), "--model", model, "--name", name, *SIM_VLLM_FLAGS, *extra)


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
