"""The request handler's parser choice: request path suffix -> parser, built once per configuration.

Matching follows the reference: the path (query string already stripped) loses a trailing ``/``,
each claimed suffix loses its surrounding ``/``, and a path matches a suffix when it ends with it
(no segment boundary). The longest matching suffix wins; between parsers claiming the same suffix the
first listed wins. A path no parser claims goes to the fallback (the first parser claiming no path),
or to none. Per request: one dictionary lookup per distinct suffix length, no regular expression.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from epp.framework.interfaces import Parser

ALL_APP_PROTOCOLS: tuple[str, ...] = ("http", "kubernetes.io/h2c")


@dataclass(slots=True, frozen=True)
class ParserRouter:
    """The parsers in use (``parsers``, listed order) and the table that picks one per path."""

    parsers: tuple[Parser, ...]
    fallback: Parser | None
    _by_suffix: dict[str, Parser]
    _lengths: tuple[int, ...]  # distinct suffix lengths, longest first

    @classmethod
    def build(cls, parsers: Sequence[Parser], warn: Callable[[str], None] | None = None) -> ParserRouter:
        """The table for ``parsers`` in order: a second parser of a type already listed is skipped;
        the first parser claiming no path becomes the fallback and ends the list (``warn`` names what
        is skipped)."""
        used: list[Parser] = []
        types: set[str] = set()
        by_suffix: dict[str, Parser] = {}
        fallback: Parser | None = None
        for i, parser in enumerate(parsers):
            if parser.type_name in types:
                if warn is not None:
                    warn(
                        f"parser '{parser.name}' skipped: a parser of type {parser.type_name} is already "
                        "registered"
                    )
            else:
                types.add(parser.type_name)
                used.append(parser)
                for suffix in parser.claims:
                    key = suffix.strip().strip("/")
                    if key:
                        by_suffix.setdefault(key, parser)
            if not parser.claims:
                fallback = parser
                if warn is not None:
                    for skipped in parsers[i + 1 :]:
                        warn(
                            f"parser '{skipped.name}' skipped: it is listed after the fallback parser "
                            f"'{parser.name}' (which claims every path no parser before it claims)"
                        )
                break
        lengths = tuple(sorted({len(k) for k in by_suffix}, reverse=True))
        return cls(tuple(used), fallback, by_suffix, lengths)

    @classmethod
    def only(cls, parser: Parser) -> ParserRouter:
        """One parser for every path."""
        return cls((parser,), parser, {}, ())

    def resolve(self, path: str) -> Parser | None:
        """The parser for ``path`` (without its query string), or ``None`` when no parser claims it."""
        path = path.strip().removesuffix("/")
        by_suffix = self._by_suffix
        n = len(path)
        for length in self._lengths:
            if length <= n:
                parser = by_suffix.get(path[n - length :])
                if parser is not None:
                    return parser
        return self.fallback

    def supported_app_protocols(self) -> tuple[str, ...]:
        """The InferencePool ``appProtocol`` values every parser in use supports (a parser that names
        none does not constrain)."""
        return _intersection(p.supported_app_protocols() for p in self.parsers)


def _intersection(sets: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    common: list[str] | None = None
    for protocols in sets:
        if not protocols:
            continue
        common = list(protocols) if common is None else [p for p in common if p in protocols]
    return ALL_APP_PROTOCOLS if common is None else tuple(common)
