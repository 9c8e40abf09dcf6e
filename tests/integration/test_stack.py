"""``epp run``: configuration helpers, and the real command (start, serve, Ctrl-C, a dying child)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from epp.dev import stack
from tests.integration.harness import chat_body, marker, request

READY_LINE = "Ctrl-C stops everything."
START_TIMEOUT = 90.0


# ------------------------------------------------------------------------------- config helpers


def test_epp_config_injects_file_discovery(tmp_path: Path) -> None:
    cfg = stack.epp_config(tmp_path / "endpoints.yaml")
    (plugin,) = cfg["plugins"]
    assert plugin["type"] == "file-discovery"
    assert plugin["parameters"] == {"path": str(tmp_path / "endpoints.yaml"), "watchFile": True}
    assert cfg["dataLayer"] == {"discovery": {"endpoints": {"pluginRef": plugin["name"]}}}  # v1
    assert cfg["kind"] == "EndpointPickerConfig"


def test_epp_config_keeps_the_users_scheduling(tmp_path: Path) -> None:
    user = yaml.safe_load(
        """
        apiVersion: llm-d.ai/v1alpha1
        kind: EndpointPickerConfig
        plugins:
        - {type: queue-scorer}
        - {name: mine, type: file-discovery, parameters: {path: /elsewhere.yaml}}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}]
        dataLayer: {metrics: {x: 1}}
        """
    )
    cfg = stack.epp_config(tmp_path / "e.yaml", user)
    assert [p["type"] for p in cfg["plugins"]] == ["queue-scorer", "file-discovery"]
    assert cfg["plugins"][1]["parameters"]["path"] == str(tmp_path / "e.yaml")
    assert cfg["dataLayer"] == {"metrics": {"x": 1}, "discovery": {"pluginRef": "mine"}}
    assert cfg["schedulingProfiles"] == user["schedulingProfiles"]
    assert user["plugins"][1]["parameters"]["path"] == "/elsewhere.yaml", "the input must not be modified"


def test_endpoints_file_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    stack.write_endpoints(path, [8000, 8001])
    first_inode = path.stat().st_ino
    stack.write_endpoints(path, [8002])
    assert path.stat().st_ino != first_inode
    assert yaml.safe_load(path.read_text())["endpoints"] == [
        {"name": "sim-0", "namespace": "default", "address": "127.0.0.1", "port": "8002", "labels": {}}
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["endpoints.yaml"]


# ------------------------------------------------------------------------------------ epp run


@dataclass
class RunningStack:
    proc: subprocess.Popen[str]
    ports: dict[str, int]
    sim_ports: list[int]
    kv_ports: list[int]
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.proc.poll() is None or text in self.output, f"epp run exited:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout}s:\n{self.output}"
            time.sleep(0.1)


def _consecutive_free_ports(count: int) -> int:
    for _ in range(50):
        base = stack.free_port()
        if base + count < 65536 and not any(stack.port_in_use(base + i) for i in range(count)):
            return base
    raise RuntimeError("no block of free ports")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def epp_run() -> Iterator[RunningStack]:
    base = _consecutive_free_ports(2)
    ports = {
        name: stack.free_port()
        for name in ("--port", "--admin-port", "--grpc-port", "--grpc-health-port", "--metrics-port")
    }
    kv_base = _consecutive_free_ports(4)
    while {kv_base + i for i in range(4)} & {*ports.values(), base, base + 1}:  # not yet bound: pick apart
        kv_base = _consecutive_free_ports(4)
    argv = [sys.executable, "-m", "epp", "run", "--sims", "2", "--sim-base-port", str(base)]
    argv += ["--kv-events", str(kv_base), "--response-phases"]
    for flag, port in ports.items():
        argv += [flag, str(port)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    running = RunningStack(proc, ports, [base, base + 1], [kv_base + i for i in range(4)])
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: running.lines.extend(iter(stdout.readline, "")), daemon=True)
    reader.start()
    try:
        yield running
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _all_ports(running: RunningStack) -> list[int]:
    return [*running.ports.values(), *running.sim_ports, *running.kv_ports]


def _listen_addresses(ports: list[int]) -> dict[int, set[str]]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on each of ``ports``."""
    found: dict[int, set[str]] = {p: set() for p in ports}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, port = local.rpartition(":")
            if state == "0A" and int(port, 16) in found:  # 0A: LISTEN
                found[int(port, 16)].add(address)
    return found


@pytest.mark.integration
def test_epp_run_serves_and_ctrl_c_stops_everything(epp_run: RunningStack) -> None:
    epp_run.wait_for(READY_LINE)
    url = f"http://127.0.0.1:{epp_run.ports['--port']}"
    assert url in epp_run.output
    long_prompt = chat_body(marker() + " tell me a long story about dragons and knights" * 4)
    resp = request(f"{url}/v1/chat/completions", "POST", long_prompt, {"content-type": "application/json"})
    assert resp.status == 200, resp
    assert resp.port in epp_run.sim_ports
    # Everything epp run starts listens on loopback only (the banner's 127.0.0.1 is the truth).
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    listening = _listen_addresses([p for p in _all_ports(epp_run) if p != epp_run.ports["--admin-port"]])
    assert all(listening.values()), f"ports not listening: {listening}"
    assert {p: a - loopback for p, a in listening.items() if a - loopback} == {}
    # The banner names the EPP socket Envoy uses: in the work dir (a killed stack leaves none in /tmp)
    workdir = re.search(r"\(work dir (\S+)\)", epp_run.output)
    assert workdir is not None, epp_run.output
    socket_path = Path(workdir.group(1)) / f"epp-{epp_run.ports['--grpc-port']}.sock"
    assert f"ext_proc unix:{socket_path} (Envoy's)" in epp_run.output
    assert socket_path.is_socket()
    # --kv-events alone routes on the events: the EPP subscribed and received the sims' batches
    assert "precise prefix routing on the simulators' KV events" in epp_run.output
    metrics_url = f"http://127.0.0.1:{epp_run.ports['--metrics-port']}/metrics"

    def received() -> float:
        return sum(
            float(line.rpartition(" ")[2])
            for line in request(metrics_url).body.decode().splitlines()
            if line.startswith("llm_d_epp_kv_cache_events_messages_received_total{")
        )

    # --response-phases: the response metrics have samples
    ttft = [
        line
        for line in request(metrics_url).body.decode().splitlines()
        if line.startswith("llm_d_epp_request_ttft_seconds_count{")
    ]
    assert ttft and float(ttft[0].rpartition(" ")[2]) >= 1, ttft
    deadline = time.monotonic() + 15
    while received() < 1:  # a batch published before the subscription was up is lost (ZMQ PUB)
        assert time.monotonic() < deadline, "the EPP received no KV-event batch"
        more = chat_body(marker() + " another story about dragons and knights" * 4)
        request(f"{url}/v1/chat/completions", "POST", more, {"content-type": "application/json"})
        time.sleep(0.2)

    # The banner names the config file the EPP watches (hot reload under epp run): a broken edit is
    # seen and refused while the stack keeps serving.
    config_line = re.search(r"config +(\S+) +\(the EPP's config", epp_run.output)
    assert config_line is not None, epp_run.output
    config_path = Path(config_line.group(1))
    assert config_path.parent == socket_path.parent and "file-discovery" in config_path.read_text()

    def reloads(result: str) -> float:
        return sum(
            float(line.rpartition(" ")[2])
            for line in request(metrics_url).body.decode().splitlines()
            if line.startswith(f'llm_d_epp_config_reloads_total{{result="{result}"}}')
        )

    broken = config_path.with_suffix(".tmp")
    broken.write_text(config_path.read_text() + "\nschedulingProfiles: 42\n")
    broken.replace(config_path)
    deadline = time.monotonic() + 15
    while reloads("invalid") < 1:
        assert time.monotonic() < deadline, "the EPP did not see the edited config file"
        time.sleep(0.2)
    resp = request(
        f"{url}/v1/chat/completions", "POST", chat_body(marker()), {"content-type": "application/json"}
    )
    assert resp.status == 200, resp
    # The metrics port's probes say what gRPC health says; other paths are 404
    metrics_base = metrics_url.removesuffix("/metrics")
    assert request(f"{metrics_base}/healthz").status == 200
    assert request(f"{metrics_base}/readyz").body == b"serving\n"
    assert request(f"{metrics_base}/no-such-page").status == 404

    epp_run.proc.send_signal(signal.SIGINT)
    assert epp_run.proc.wait(30) == 0, epp_run.output
    still_listening = [p for p in _all_ports(epp_run) if _listening(p)]
    assert still_listening == [], f"ports still served after Ctrl-C: {still_listening}"
    assert not socket_path.parent.exists(), "the work dir (and the socket in it) is removed"


def _pid_of(subcommand: str, needle: str) -> int | None:
    """The pid of the ``epp <subcommand>`` process whose command line contains ``needle``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_text()
        except OSError:
            continue
        if f"\0{subcommand}\0" in cmdline and needle in cmdline:
            return int(entry.name)
    return None


def _pid_of_sim(port: int) -> int:
    pid = _pid_of("sim", f"--port\0{port}\0")
    if pid is None:
        raise AssertionError(f"no simulator process for port {port}")
    return pid


def _pid_of_epp(grpc_port: int) -> int:
    pid = _pid_of("serve", f"--grpc-port={grpc_port}\0")
    if pid is None:
        raise AssertionError(f"no epp serve process for gRPC port {grpc_port}")
    return pid


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_epp_run_stops_everything_when_the_epp_dies(epp_run: RunningStack) -> None:
    epp_run.wait_for(READY_LINE)
    os.kill(_pid_of_epp(epp_run.ports["--grpc-port"]), signal.SIGKILL)
    assert epp_run.proc.wait(30) == 1, epp_run.output
    epp_run.wait_for("epp exited unexpectedly", timeout=5)
    still_listening = [p for p in _all_ports(epp_run) if _listening(p)]
    assert still_listening == [], f"ports still served after a child died: {still_listening}"
    kept = re.search(r"logs kept in (\S+)", epp_run.output)
    assert kept is not None, epp_run.output
    logs = Path(kept.group(1))
    assert (logs / "epp.log").is_file()
    shutil.rmtree(logs.parent, ignore_errors=True)  # the work dir epp run kept for the post-mortem


def _chat_through(url: str) -> tuple[int, int | None]:
    try:
        resp = request(
            f"{url}/v1/chat/completions",
            "POST",
            chat_body(marker()),
            {"content-type": "application/json"},
            timeout=10,
        )
    except OSError:
        return 0, None
    return resp.status, resp.port


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_epp_run_restarts_a_killed_simulator(epp_run: RunningStack) -> None:
    epp_run.wait_for(READY_LINE)
    url = f"http://127.0.0.1:{epp_run.ports['--port']}"
    victim_port = epp_run.sim_ports[1]
    old_pid = _pid_of_sim(victim_port)
    os.kill(old_pid, signal.SIGKILL)

    # While it is down and coming back, the stack keeps running and the other simulator serves.
    served_by_survivor = 0
    deadline = time.monotonic() + 60
    while "sim-1 restarted" not in epp_run.output or not served_by_survivor:
        assert epp_run.proc.poll() is None, f"epp run exited after a simulator was killed:\n{epp_run.output}"
        assert time.monotonic() < deadline, (
            f"sim-1 was not restarted, or sim-0 did not serve:\n{epp_run.output}"
        )
        status, port = _chat_through(url)
        if status == 200 and port == epp_run.sim_ports[0]:
            served_by_survivor += 1
        time.sleep(0.05)
    assert served_by_survivor > 0, epp_run.output
    assert re.search(r"sim-1 exited \(killed by SIGKILL\); restarting it in", epp_run.output), epp_run.output

    stack.wait_until(
        "the restarted sim-1", lambda: stack.http_status(f"http://127.0.0.1:{victim_port}/health") == 200
    )
    assert _pid_of_sim(victim_port) != old_pid

    # Back in service: every request succeeds and the restarted simulator serves its share.
    results = [_chat_through(url) for _ in range(40)]
    assert [s for s, _ in results] == [200] * len(results), results
    assert victim_port in {p for _, p in results}, results
    assert epp_run.proc.poll() is None, epp_run.output


def _stale_socket(path: Path) -> None:
    """A Unix socket file with no listener, as a process killed outright leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    assert path.is_socket()


@pytest.mark.integration
def test_local_stack_serves_on_a_socket_in_its_work_dir_over_a_stale_one(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    opts = stack.StackOptions.on_free_ports(1, epp_args=["--log-level", "warning"])
    path = workdir / f"epp-{opts.grpc_port}.sock"
    _stale_socket(path)
    with stack.LocalStack(opts, workdir) as st:  # start() returns once requests flow through Envoy
        assert st.opts.epps()[0].socket == str(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))  # the EPP listens on it (the stale one was replaced)
        resp = request(
            f"{st.url}/v1/chat/completions", "POST", chat_body(marker()), {"content-type": "application/json"}
        )
        assert resp.status == 200, resp
        assert resp.port == opts.sim_base_port
    assert not path.exists(), "the EPP removes its socket when it stops"


def test_supervisor_restarts_with_backoff_then_gives_up(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = stack.Supervisor(tmp_path / "logs", log=lines.append)
    policy = stack.RestartPolicy(max_restarts=2, window=60.0, backoff=0.05, max_backoff=0.2)
    crashing = sup.start("crashing", [sys.executable, "-c", "import sys; sys.exit(3)"], restart=policy)
    steady = sup.start("steady", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fatal = None
        deadline = time.monotonic() + 30
        while fatal is None:
            assert time.monotonic() < deadline, lines
            fatal = sup.poll()
            time.sleep(0.02)
        assert fatal is crashing
        assert len(crashing.restarts) == 2
        assert steady.running(), "a restart must not touch the other children"
        assert [line.split(";")[0] for line in lines if "restarting" in line] == [
            "crashing exited (status 3)",
            "crashing exited (status 3)",
        ]
        assert "restarting it in 0.05 s" in lines[0] and "restarting it in 0.1 s" in lines[2], lines
        assert sum("crashing restarted (pid" in line for line in lines) == 2, lines
        assert "giving up" in lines[-1], lines
        # The log file is appended to by every run of the child.
        assert (tmp_path / "logs" / "crashing.log").is_file()

        assert sup.poll() is crashing, "a child that gave up stays fatal"
        steady.kill()
        assert sup.exited() is crashing
    finally:
        sup.stop_all()


def test_supervisor_child_without_a_policy_is_fatal_at_once(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = stack.Supervisor(tmp_path / "logs", log=lines.append)
    with sup:
        child = sup.start("plain", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert sup.poll() is None
        child.kill()
        assert sup.poll() is child
        assert lines == [], "nothing is restarted"
