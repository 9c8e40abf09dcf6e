"""Where epp run's EPPs put their Unix sockets: in the stack's work directory (removed with it), in
the temporary directory when that path would be too long for a socket, an error when neither fits."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from epp.dev.envoy.bootstrap import EXT_PROC_CLUSTER
from epp.dev.stack import LocalStack, StackOptions, epp_socket
from epp.dev.stack.cli import _usage
from epp.dev.stack.commands import SOCKET_PATH_MAX
from epp.dev.stack.supervisor import Child


def _long_dir(parent: Path, total: int) -> Path:
    """A directory under ``parent`` whose path is ``total`` bytes long."""
    return parent / ("d" * (total - len(str(parent)) - 1))


def _pipes(bootstrap: dict[str, Any]) -> list[str]:
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == EXT_PROC_CLUSTER]
    hosts = [h for e in cluster["load_assignment"]["endpoints"] for h in e["lb_endpoints"]]
    return [h["endpoint"]["address"]["pipe"]["path"] for h in hosts]


def test_the_socket_goes_into_the_directory_given(tmp_path: Path) -> None:
    assert epp_socket(9002, tmp_path) == f"{tmp_path}/epp-9002.sock"
    assert epp_socket(9002, str(tmp_path)) == f"{tmp_path}/epp-9002.sock"
    assert epp_socket(9002) == f"{tempfile.gettempdir()}/epp-9002.sock"


def test_a_directory_too_long_for_a_socket_path_falls_back_to_the_temporary_directory(tmp_path: Path) -> None:
    name = "/epp-9002.sock"
    fits = _long_dir(tmp_path, SOCKET_PATH_MAX - len(name))
    assert epp_socket(9002, fits) == f"{fits}{name}"
    assert len(epp_socket(9002, fits)) == SOCKET_PATH_MAX
    too_long = _long_dir(tmp_path, SOCKET_PATH_MAX - len(name) + 1)
    assert epp_socket(9002, too_long) == f"{tempfile.gettempdir()}{name}"


def test_no_short_enough_path_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    long_tmp = _long_dir(tmp_path, 120)
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    with pytest.raises(ValueError, match=r"over the 107-byte limit of a socket path: set TMPDIR"):
        epp_socket(9002, long_tmp)
    # epp run refuses before starting anything (its work dir would be under TMPDIR too)
    stack = LocalStack(StackOptions.on_free_ports(1, replicas=2), long_tmp)
    with pytest.raises(ValueError, match=r"epp-\d+\.sock is \d+ bytes, over the 107-byte limit"):
        stack.start()
    assert stack.children == []


def test_one_epp_listens_and_envoy_calls_it_in_the_work_dir(tmp_path: Path) -> None:
    stack = LocalStack(StackOptions(sims=2, grpc_port=9002), tmp_path)
    (ports,) = stack.opts.epps()
    assert ports.socket == f"{tmp_path}/epp-9002.sock"
    assert _pipes(stack.bootstrap()) == [f"{tmp_path}/epp-9002.sock"]
    stack.epps = [Child("epp", [], tmp_path / "epp.log")]
    assert f"ext_proc unix:{tmp_path}/epp-9002.sock (Envoy's) and 127.0.0.1:9002" in _usage(stack)


def test_every_replica_socket_is_in_the_work_dir(tmp_path: Path) -> None:
    opts = StackOptions.on_free_ports(1, replicas=3)
    stack = LocalStack(opts, tmp_path)
    assert opts.socket_dir == "", "the caller's options are left as they were"
    grpc = [e.grpc for e in opts.replica_ports or []]
    expected = [f"{tmp_path}/epp-{port}.sock" for port in grpc]
    assert [e.socket for e in stack.opts.epps()] == expected
    assert _pipes(stack.bootstrap()) == expected


def test_a_socket_dir_in_the_options_is_kept(tmp_path: Path) -> None:
    opts = StackOptions(sims=1, replicas=2, socket_dir=str(tmp_path / "sockets"))
    stack = LocalStack(opts, tmp_path / "work")
    assert [e.socket for e in stack.opts.epps()] == [
        f"{tmp_path}/sockets/epp-9002.sock",
        f"{tmp_path}/sockets/epp-9102.sock",
    ]
