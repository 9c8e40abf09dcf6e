"""epp run refuses ports another process holds, naming for each the flag that moves it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from epp.dev.stack.local import LocalStack, StackOptions


def _hold(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _refused(opts: StackOptions, work: Path, busy: list[int]) -> tuple[LocalStack, str]:
    """The stack of ``opts`` started while other sockets hold ``busy``: it and its refusal."""
    held = [_hold(p) for p in busy]
    try:
        stack = LocalStack(opts, work)
        with pytest.raises(RuntimeError) as err:
            stack.start()
    finally:
        for s in held:
            s.close()
    return stack, str(err.value)


def test_busy_ports_are_named_with_the_flag_that_moves_them(tmp_path: Path) -> None:
    opts = StackOptions.on_free_ports(2, kv_events=True)
    busy = [opts.sim_base_port + 1, opts.metrics_port, opts.kv_events_base_port]
    stack, message = _refused(opts, tmp_path, busy)
    assert message == (
        f"ports already in use: {opts.kv_events_base_port} (--kv-events), "
        f"{opts.sim_base_port + 1} (--sim-base-port), {opts.metrics_port} (--metrics-port); "
        "move them with those epp run flags"
    )
    assert stack.supervisor.children == []  # nothing was started


def test_a_busy_replica_or_redis_port_names_its_flag(tmp_path: Path) -> None:
    opts = StackOptions.on_free_ports(1, replicas=2)
    second = opts.epps()[1]
    stack, message = _refused(opts, tmp_path, [second.health, opts.redis_port])
    assert message == (
        f"ports already in use: {second.health} (--grpc-health-port, replica 1), "
        f"{opts.redis_port} (--redis-port); move them with those epp run flags"
    )
    assert stack.children == []  # Redis was not started either


def test_no_busy_port_no_message() -> None:
    assert StackOptions.on_free_ports(1).busy_ports() == ""


def test_epp_run_with_a_busy_port_says_which_flag_and_leaves_no_work_dir(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from epp.cli import main

    opts = StackOptions.on_free_ports(1)
    held = _hold(opts.port)
    try:
        code = main(
            [
                "run",
                "--sims=1",
                f"--sim-base-port={opts.sim_base_port}",
                f"--port={opts.port}",
                f"--admin-port={opts.admin_port}",
                f"--grpc-port={opts.grpc_port}",
                f"--grpc-health-port={opts.health_port}",
                f"--metrics-port={opts.metrics_port}",
            ]
        )
    finally:
        held.close()
    out, err = capsys.readouterr()
    assert code == 1
    assert f"error: ports already in use: {opts.port} (--port); move them with those epp run flags" in err
    assert "logs kept" not in err
    workdir = Path(out.split("(work dir ", 1)[1].split(")", 1)[0])
    assert not workdir.exists()
