"""Process supervision for the local stack.

Each :class:`Child` runs in its own process group (a stop reaches its own children too) and, on
Linux, gets SIGTERM if its parent dies (``setpriv --pdeathsig``): no orphans even after ``kill -9``.
A :class:`Supervisor` restarts the children that have a :class:`RestartPolicy` and reports the
first one whose exit is fatal.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

STOP_TIMEOUT = 5.0
SIM_MAX_RESTARTS = 5
SIM_RESTART_WINDOW = 60.0


# util-linux's setpriv sets the parent-death signal and then execs the command, so no Python code
# runs in the child between fork and exec (a preexec_fn would force fork(), whose gRPC fork handlers
# can abort the child while other threads of this process use gRPC).
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


def _dies_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv``, run so that the kernel sends it SIGTERM when its parent dies (where setpriv exists)."""
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *argv] if _SETPRIV else list(argv)


@dataclass
class Child:
    """One child process, started in its own process group with stdout+stderr in ``log_path``."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    restart: RestartPolicy | None = None  # None: its exit is fatal to the supervisor
    restarts: deque[float] = field(default_factory=deque, repr=False)  # monotonic times of restarts
    restart_due: float | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> Child:
        """Start the process (stdin closed, output appended to the log file)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            _dies_with_parent(self.argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        return self

    def respawn(self) -> Child:
        """Start the process again with the same command line (after it exited or was stopped)."""
        self.stop()
        return self.start()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``; idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_group(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._signal_group(signal.SIGKILL)
                    self.proc.wait(timeout)
            # Grandchildren left in the group (if any) go too.
            self._signal_group(signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL the process group at once (simulates a crash)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the child's output."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a child that exits is started again: after ``backoff`` x 2^(recent restarts) seconds (at
    most ``max_backoff``), and at most ``max_restarts`` times within ``window`` seconds."""

    max_restarts: int = SIM_MAX_RESTARTS
    window: float = SIM_RESTART_WINDOW
    backoff: float = 0.5
    max_backoff: float = 8.0

    def delay(self, recent: int) -> float:
        return float(min(self.backoff * 2**recent, self.max_backoff))


def _describe_status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Supervisor:
    """Starts children, restarts those with a :class:`RestartPolicy` when they exit, notices one
    whose exit is fatal, and stops them all (in reverse start order)."""

    def __init__(self, log_dir: Path, log: Callable[[str], None] = _stderr_line) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.log = log

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        restart: RestartPolicy | None = None,
    ) -> Child:
        child = Child(name, list(argv), self.log_dir / f"{name}.log", env=env, restart=restart).start()
        self.children.append(child)
        return child

    def exited(self) -> Child | None:
        """The first child that is no longer running, if any."""
        return next((c for c in self.children if not c.running()), None)

    def poll(self, now: float | None = None) -> Child | None:
        """One supervision step: schedule or perform due restarts; return a child whose exit is fatal.

        A child without a policy that exited, or one that already used ``max_restarts`` restarts
        within the policy's window, is fatal. Call it periodically (``epp run`` does, every 0.2 s).
        """
        now = time.monotonic() if now is None else now
        for child in self.children:
            policy = child.restart
            if child.running():
                continue
            if policy is None:
                return child
            if child.restart_due is None:
                while child.restarts and now - child.restarts[0] > policy.window:
                    child.restarts.popleft()
                status = _describe_status(child.returncode())
                if len(child.restarts) >= policy.max_restarts:
                    self.log(
                        f"{child.name} exited ({status}) after {len(child.restarts)} restarts within "
                        f"{policy.window:g} s; giving up"
                    )
                    return child
                delay = policy.delay(len(child.restarts))
                child.restart_due = now + delay
                self.log(
                    f"{child.name} exited ({status}); restarting it in {delay:g} s "
                    f"(restart {len(child.restarts) + 1} of at most {policy.max_restarts} "
                    f"in {policy.window:g} s)"
                )
            elif now >= child.restart_due:
                child.restart_due = None
                child.restarts.append(now)
                try:
                    child.respawn()
                except OSError as e:
                    self.log(f"{child.name} could not be restarted: {e}")
                    return child
                self.log(f"{child.name} restarted (pid {child.pid})")
        return None

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


class ChildExited(RuntimeError):
    """A child process exited while the stack was starting or running."""

    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with status {child.returncode()}")
        self.child = child
