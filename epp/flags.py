"""Go-style flag values shared by the subcommands: ``--flag=false`` booleans and durations."""

from __future__ import annotations

import argparse
import re

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``50ms``, ``2s``, ``1m30s`` or a plain number of seconds -> seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 50ms, 2s, 1m30s)")
    return total


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
