"""Go duration strings (``"200ms"``, ``"1.5s"``, ``"1h30m"``, ``"-2s"``, ``"0"``) in seconds."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 MICRO SIGN
    "μs": 1e-6,  # U+03BC GREEK SMALL LETTER MU
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_go_duration(text: str) -> float | None:
    """Seconds of a Go duration (surrounding blanks ignored); None when ``text`` is not one.

    Every number needs a unit, except a lone ``0``; a leading sign applies to the whole duration.
    """
    s = text.strip()
    sign = -1.0 if s[:1] == "-" else 1.0
    if s[:1] in ("+", "-"):
        s = s[1:]
    if s == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(s):
        m = _PART.match(s, pos)
        if m is None:
            return None
        total += float(m[1]) * _UNIT_SECONDS[m[2]]
        pos = m.end()
    return sign * total if s else None
