"""epp run's pass-through flags: --sim-arg and --epp-arg take another program's flag as their value,
with or without '=' (as their help and the docs write them)."""

from __future__ import annotations

import argparse

import pytest

from epp.cli import _go_bool_flags, _pass_through_values, build_parser


def _parse_run(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(_go_bool_flags(_pass_through_values(["run", *argv])))


def test_epp_arg_takes_a_flag_as_its_value_with_or_without_equals() -> None:
    args = _parse_run("--epp-arg", "--log-level=debug", "--epp-arg=--tracing", "--sims", "1")
    assert args.epp_arg == ["--log-level=debug", "--tracing"]
    assert args.sims == 1


def test_sim_and_epp_args_mixed() -> None:
    args = _parse_run("--sim-arg", "--max-num-seqs=2", "--epp-arg", "--objectives-file=o.yaml")
    assert args.sim_arg == ["--max-num-seqs=2"]
    assert args.epp_arg == ["--objectives-file=o.yaml"]


def test_a_trailing_epp_arg_without_a_value_is_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse_run("--epp-arg")
    assert exit_.value.code == 2
    assert "--epp-arg: expected one argument" in capsys.readouterr().err
