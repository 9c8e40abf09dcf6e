"""Go-style flag values shared by the subcommands: ``--flag=false`` booleans and durations."""

from __future__ import annotations

import argparse

from epp.framework.durations import parse_go_duration


def parse_duration(text: str) -> float:
    """A Go duration (``50ms``, ``2s``, ``1m30s``) or a plain number of seconds -> seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    seconds = parse_go_duration(text)
    if seconds is None:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 50ms, 2s, 1m30s)")
    return seconds


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes", "on"):
        return True
    if value in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


def add_bool(parser: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    """``--name``, ``--name=true`` and ``--name=false`` all work, as with Go flags."""
    parser.add_argument(
        name, type=parse_bool, nargs="?", const=True, default=default, metavar="BOOL", help=help
    )
