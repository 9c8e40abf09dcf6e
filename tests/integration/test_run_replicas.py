"""``epp run --replicas 2`` (its :class:`LocalStack`, and the command): two EPPs behind one Envoy
share state through the stack's own ``redis-server``; a replica killed with SIGKILL leaves the other
serving every request, and the supervisor brings it back; Ctrl-C stops Redis with the rest."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from epp.dev import stack
from epp.dev.envoy.bootstrap import EXT_PROC_CLUSTER
from tests.integration.harness import request
from tests.integration.test_stack import _listen_addresses
from tests.redis_fixture import require_redis_server

pytestmark = pytest.mark.integration


def _metric(port: int, name: str) -> float:
    """Sum of every sample of ``name`` on the EPP's metrics page at ``port`` (-1 when unreachable)."""
    try:
        text = request(f"http://127.0.0.1:{port}/metrics", timeout=2).body.decode()
    except OSError:
        return -1.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait(what: str, condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def _healthy(st: stack.LocalStack) -> int:
    text = request(f"http://127.0.0.1:{st.opts.admin_port}/clusters").body.decode()
    prefix = f"{EXT_PROC_CLUSTER}::"
    return sum(
        1
        for line in text.splitlines()
        if line.startswith(prefix) and line.endswith("::health_flags::healthy")
    )


def _chat(st: stack.LocalStack, i: int) -> int:
    body = json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 2}
    ).encode()
    resp = request(st.url + "/v1/chat/completions", "POST", body, {"content-type": "application/json"}, 10)
    return resp.status


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[stack.LocalStack]:
    require_redis_server()
    opts = stack.StackOptions.on_free_ports(2, replicas=2, epp_args=["--log-level", "warning"])
    st = stack.LocalStack(opts, tmp_path)
    with st:
        yield st


# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp* write them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
REQUESTS = "llm_d_epp_request_total"
PEERS = "llm_d_epp_cross_replica_peers"


def test_two_replicas_share_redis_serve_streams_and_survive_a_sigkill(replicas: stack.LocalStack) -> None:
    st = replicas
    first, second = st.opts.epps()
    assert st.redis is not None and st.redis.running()
    assert [c.name for c in st.epps] == ["epp-0", "epp-1"]
    # Everything (Envoy, the replicas' ports, Redis, the sims) listens on the loopback only.
    ports = [*st.opts.all_ports(), st.redis_port]
    listening = _listen_addresses(ports)
    assert st.redis_port and all(a and a <= LOOPBACK for a in listening.values()), {
        p: a for p, a in listening.items() if not (a and a <= LOOPBACK)
    }
    _wait(
        "each replica sees the other",
        lambda: _metric(first.metrics, PEERS) == _metric(second.metrics, PEERS) == 1,
    )

    # Envoy spreads the streams: both replicas route requests (round robin per Envoy worker).
    for i in range(16):
        assert _chat(st, i) == 200
    served = [_metric(e.metrics, REQUESTS) for e in (first, second)]
    assert sum(served) == 16 and min(served) >= 4, served

    # SIGKILL one: every request goes through the other at once (fail-closed). Until its next health
    # check Envoy may still pick the dead replica; the refused stream is opened again on the other.
    st.epps[1].kill()
    before = _metric(first.metrics, REQUESTS)
    for i in range(10):
        assert _chat(st, 100 + i) == 200
    assert _metric(first.metrics, REQUESTS) == before + 10
    _wait("the killed replica unhealthy in Envoy", lambda: _healthy(st) == 1, timeout=5)
    _wait("the survivor stops counting the dead peer", lambda: _metric(first.metrics, PEERS) == 0, timeout=5)

    # The supervisor (epp run polls it) restarts the replica on its ports; it rejoins.
    _wait("the replica restarted", lambda: st.poll() is None and st.epps[1].running(), timeout=5)
    _wait("both healthy in Envoy again", lambda: _healthy(st) == 2, timeout=30)
    _wait("peers again", lambda: _metric(first.metrics, PEERS) == _metric(second.metrics, PEERS) == 1)


def _free_with_replica(step: int = stack.local.REPLICA_PORT_STEP) -> int:
    """A free port whose replica-1 twin (+ ``step``) is free too."""
    for _ in range(50):
        port = stack.free_port()
        if port + step < 65536 and not stack.port_in_use(port + step):
            return port
    raise RuntimeError("no free port pair")


def test_the_epp_run_command_with_two_replicas_and_ctrl_c(tmp_path: Path) -> None:
    require_redis_server()
    flags = {f: _free_with_replica() for f in ("--grpc-port", "--grpc-health-port", "--metrics-port")}
    flags |= {f: stack.free_port() for f in ("--port", "--admin-port", "--redis-port", "--sim-base-port")}
    argv = [sys.executable, "-m", "epp", "run", "--sims", "1", "--replicas", "2"]
    argv += [f"{f}={p}" for f, p in flags.items()]
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait("the banner", lambda: "Ctrl-C stops everything." in out.read_text(), timeout=60)
        text = out.read_text()
        assert "2 replicas, all serving" in text
        found = re.search(r"\(work dir (\S+)\)", text)
        assert found is not None, text
        workdir = Path(found.group(1))
        for i in range(2):
            grpc = flags["--grpc-port"] + 100 * i
            socket_path = workdir / f"epp-{grpc}.sock"  # in the work dir: never left behind in /tmp
            assert f"epp-{i}    ext_proc unix:{socket_path} and 127.0.0.1:{grpc}" in text
            assert socket_path.is_socket()
        assert f"Redis      127.0.0.1:{flags['--redis-port']}" in text
        url = f"http://127.0.0.1:{flags['--port']}/v1/chat/completions"
        body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}).encode()
        assert request(url, "POST", body, {"content-type": "application/json"}, 10).status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, out.read_text()
        assert not stack.port_in_use(flags["--redis-port"]), "redis-server outlived epp run"
        assert not workdir.exists(), "the work dir, sockets included, is removed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
