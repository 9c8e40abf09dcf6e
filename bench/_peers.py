"""The routers users would pick instead of epp, on the same simulators (``make bench-routing``).

vllm-router and sglang-router (PyPI wheels) run from their own virtual environment, ``.bench-venv``
at the repository root, created on first use so the project's dependencies stay as they are. A peer
that cannot be installed or started is reported with the reason, and the bench goes on without it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from epp.dev import stack

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench-venv"
INSTALL_TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer router: its PyPI package and its command line over ``workers``."""

    name: str
    package: str
    argv: Callable[[Path, int, int, Sequence[str]], list[str]]  # (venv python, port, metrics, workers)


def _vllm_router(python: Path, port: int, metrics: int, workers: Sequence[str]) -> list[str]:
    exe = python.parent / "vllm-router"
    return [
        str(exe),
        *("--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), "--log-level", "warning"),
        "--worker-urls",
        *workers,
    ]


def _sglang_router(python: Path, port: int, metrics: int, workers: Sequence[str]) -> list[str]:
    return [
        str(python),
        *("-m", "sglang_router.launch_router"),
        *("--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), "--log-level", "warn"),
        "--worker-urls",
        *workers,
    ]


PEERS: dict[str, Peer] = {
    "vllm-router": Peer("vllm-router", "vllm-router", _vllm_router),
    "sglang-router": Peer("sglang-router", "sglang-router", _sglang_router),
}


def ensure_venv(packages: Sequence[str]) -> tuple[Path | None, dict[str, str]]:
    """The bench venv's python with ``packages`` installed, and per package the reason it is missing."""
    python = VENV / "bin" / "python"
    problems: dict[str, str] = {}
    if not python.exists():
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(VENV)],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if made.returncode != 0:
            reason = f"cannot create {VENV}: {made.stderr.strip()[-300:]}"
            return None, dict.fromkeys(packages, reason)
    for package in packages:
        if _installed(python, package):
            continue
        print(f"installing {package} into {VENV} (first run only)", flush=True)
        try:
            done = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", package],
                capture_output=True,
                text=True,
                check=False,
                timeout=INSTALL_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            problems[package] = f"pip install {package} took over {INSTALL_TIMEOUT:.0f} s"
            continue
        if done.returncode != 0 or not _installed(python, package):
            problems[package] = f"pip install {package} failed: {done.stderr.strip()[-300:]}"
    return python, problems


def _installed(python: Path, package: str) -> bool:
    shown = subprocess.run(
        [str(python), "-m", "pip", "show", "-q", package], capture_output=True, check=False, timeout=120
    )
    return shown.returncode == 0


class PeerStack(stack.Stack):
    """``sims`` fresh ``epp sim`` servers and ``peer`` in front of them, on free ports."""

    def __init__(
        self, workdir: Path, peer: Peer, python: Path, sims: int, sim_args: Sequence[str], model: str
    ) -> None:
        super().__init__(workdir)
        self.peer = peer
        self.python = python
        self.sim_ports = stack.free_ports(sims)
        self.sim_args = list(sim_args)
        self.model = model
        self.port, self.metrics_port = stack.free_ports(2)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port}"]

    def start(self) -> None:
        sims = [
            (self.start_sim(f"sim-{i}", port, model=self.model, args=self.sim_args), port)
            for i, port in enumerate(self.sim_ports)
        ]
        for child, port in sims:
            self.wait_sim(child, f"http://127.0.0.1:{port}")
        workers = [f"http://127.0.0.1:{port}" for port in self.sim_ports]
        router = self.supervisor.start(
            self.peer.name, self.peer.argv(self.python, self.port, self.metrics_port, workers)
        )
        self.wait(
            f"{self.peer.name} answering GET /v1/models",
            stack.http_ok(f"{self.urls[0]}/v1/models"),
            children=[router],
        )

    def alive(self) -> None:
        dead = self.supervisor.exited()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited ({dead.returncode()}):\n{dead.tail(20)}")

    def __enter__(self) -> PeerStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self
