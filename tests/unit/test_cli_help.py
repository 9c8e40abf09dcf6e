"""The commands' --help: every default is written one way, "(default X)", so a reader finds it."""

from __future__ import annotations

import re

import pytest

from epp.cli import main

# A parenthesised value ("(5s)", "(1000; 0: all)", "(100 per second)", "(365)") is a default
# written without the word: the second way of writing the same thing.
_BARE_DEFAULT = re.compile(r"\((?!default )\d[\d.]*\s*(?:[A-Za-z]{1,3}|per second)?\s*[;)]")


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone


@pytest.mark.parametrize("command", ["serve", "run", "sim", "envoy-config", "certs", "plugins"])
def test_every_default_in_a_commands_help_says_default(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help(command, capsys)
    assert "--" in text  # the flags are there
    bare = [text[max(0, m.start() - 60) : m.end()] for m in _BARE_DEFAULT.finditer(text)]
    assert bare == []


def test_envoy_config_help_names_the_listener_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--listen-host LISTEN_HOST listener address (default 127.0.0.1;" in _help("envoy-config", capsys)


def test_serve_help_is_grouped_and_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from epp.cli import build_parser

    parser = build_parser()
    serve = next(a.choices["serve"] for a in parser._actions if isinstance(getattr(a, "choices", None), dict))
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--")}
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert all(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text) for f in flags)
    # Only --help sits in the catch-all section: every flag is under a named group.
    untitled = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"--[\w-]+", untitled) == ["--help"]
    for group in ("ports and shutdown", "configuration", "requests and routing", "explaining decisions"):
        assert f"\n{group}" in text
    assert len(text.splitlines()) < 356
