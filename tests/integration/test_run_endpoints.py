"""``epp run --endpoints`` (the stack in front of engines it did not start) and ``--engine vllm``'s
refusal where ``make engines`` has not run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from epp.dev import stack
from epp.dev.stack.cli import add_arguments, options_from_args
from tests.integration.harness import SIM_ARGS, chat_body, marker, request


def _options(*argv: str) -> stack.StackOptions:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_endpoints_flag_parses_urls_and_starts_no_engine() -> None:
    opts = _options("--endpoints", "http://10.0.0.5:8000, 127.0.0.1:8001/")
    assert opts.endpoints == ["10.0.0.5:8000", "127.0.0.1:8001"]
    assert opts.sims == 0 and opts.sim_ports == []
    assert opts.upstreams == ["10.0.0.5:8000", "127.0.0.1:8001"]


@pytest.mark.parametrize("bad", ["https://h:1", "h", "http://h:1/v1", "ftp://h:2"])
def test_endpoints_flag_refuses_what_is_not_http_host_port(bad: str) -> None:
    with pytest.raises(SystemExit, match="--endpoints"):
        _options("--endpoints", bad)


def test_engine_vllm_refused_without_make_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_ENGINES_VENV", str(tmp_path / "none"))
    with pytest.raises(SystemExit, match="make engines"):
        _options("--engine", "vllm")


@pytest.mark.integration
def test_local_stack_in_front_of_engines_it_did_not_start(tmp_path: Path) -> None:
    port = stack.free_port()
    sup = stack.Supervisor(tmp_path / "engine-logs")
    engine = sup.start("outside", stack.sim_argv(port, "outside", "demo", SIM_ARGS))
    try:
        stack.wait_until(
            "outside /health", stack.http_ok(f"http://127.0.0.1:{port}/health"), children=[engine]
        )
        base = stack.StackOptions.on_free_ports(1, epp_args=["--log-level", "warning"])
        opts = stack.StackOptions(
            sims=0,
            endpoints=[f"127.0.0.1:{port}"],
            port=base.port,
            admin_port=base.admin_port,
            grpc_port=base.grpc_port,
            health_port=base.health_port,
            metrics_port=base.metrics_port,
            epp_args=base.epp_args,
        )
        workdir = tmp_path / "work"
        workdir.mkdir()
        with stack.LocalStack(opts, workdir) as st:
            assert not st.sims
            resp = request(
                f"{st.url}/v1/chat/completions",
                "POST",
                chat_body(marker()),
                {"content-type": "application/json"},
            )
            assert resp.status == 200, resp
            assert resp.port == port
    finally:
        sup.stop_all()
