"""A private ``redis-server`` on 127.0.0.1 for ``epp run --replicas`` and the tests: no persistence,
killable and restartable on the same port (a restart loses every key, as a real one without
persistence does)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from epp.dev.stack.probes import free_port

DEBIAN_PACKAGE = "redis-server"


def redis_server_binary() -> str | None:
    """The ``redis-server`` on PATH, or None."""
    return shutil.which("redis-server")


def missing_message(what: str) -> str:
    """The error when ``redis-server`` is not on PATH: which package provides it."""
    return (
        f"{what} needs redis-server, which is not on PATH: install the Debian package {DEBIAN_PACKAGE} "
        f"(apt-get install {DEBIAN_PACKAGE})"
    )


def redis_argv(binary: str, port: int, work_dir: Path, password: str = "") -> list[str]:
    """``redis-server`` on 127.0.0.1:``port`` without persistence (its working directory ``work_dir``)."""
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(work_dir),
    ]
    if password:
        argv += ["--requirepass", password]
    return argv


def redis_pong(port: int) -> bool:
    """True when the (password-less) Redis on 127.0.0.1:``port`` answers PING."""
    return _pong(port)


def _pong(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server --port N --save '' --appendonly no`` process; ``port`` 0 picks a free one."""

    def __init__(self, log_dir: Path, port: int = 0, password: str = "") -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError(f"redis-server not found (Debian package {DEBIAN_PACKAGE})")
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        self.log_dir = log_dir
        self.log_path = log_dir / f"redis-{self.port}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        argv = redis_argv(self.binary, self.port, self.log_dir, self.password)
        log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self._proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server not answering on {self.address} in {timeout} s")
            time.sleep(0.02)
        return self

    def _ready(self) -> bool:
        if not self.password:
            return _pong(self.port)
        try:  # with a password an unauthenticated PING is refused: a NOAUTH answer means it is up
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return bool(s.recv(64))
        except OSError:
            return False

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the server stops answering (a slow or frozen store)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and wait: every key is lost."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused one too
            proc.kill()
            proc.wait(5)

    def restart(self) -> None:
        """Kill, then start again on the same port, empty."""
        self.kill()
        self.start()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
