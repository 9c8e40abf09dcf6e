"""A long JSON request body read lazily: a top-level member becomes Python objects only when read.

simdjson validates the whole body, its UTF-8 included, in one pass, about twice as fast as building
every object of it; what scheduling reads of an agentic conversation (``model``, ``stream``, the first
messages for prefix hashing) is then all that is converted. ``settle()`` lets simdjson's buffers go
(the director calls it once the request is scheduled, or when flow control queues it); a member read
after that comes from one full parse of the raw bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson
import simdjson

_MISSING = object()

# Parsers kept for reuse: a new one maps fresh memory (several times the body) and pays its page
# faults on every request. One is reused only once its document is settled; bodies above
# POOLED_UP_TO bytes get a parser of their own, so the pool's memory stays bounded.
_POOL: list[simdjson.Parser] = []
POOL_SIZE = 4
POOLED_UP_TO = 2 << 20
_REUSE_ERROR = "Tried to re-use a parser"


def _parse(raw: bytes) -> tuple[simdjson.Parser, Any]:
    """A parser and its document of ``raw`` (ValueError/RuntimeError: simdjson rejects it)."""
    if _POOL and len(raw) <= POOLED_UP_TO:
        parser = _POOL.pop()
        try:
            return parser, parser.parse(raw)
        except RuntimeError as e:  # a value of its last document is still referenced somewhere
            if not str(e).startswith(_REUSE_ERROR):
                raise
    parser = simdjson.Parser()
    return parser, parser.parse(raw)


def _plain(value: Any) -> Any:
    """A simdjson value as the Python objects orjson would build."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


class LazyObject(Mapping[str, Any]):
    """The body's top-level JSON object, converting each member on first read."""

    __slots__ = ("_doc", "_keys", "_parser", "_raw", "_values")

    def __init__(
        self, raw: bytes, parser: simdjson.Parser, doc: simdjson.Object, keys: frozenset[str]
    ) -> None:
        self._raw = raw
        self._parser: simdjson.Parser | None = parser
        self._doc: simdjson.Object | None = doc
        self._keys = keys
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        value = self._values.get(key, _MISSING)
        if value is not _MISSING:
            return value
        if key not in self._keys:
            raise KeyError(key)
        doc = self._doc
        if doc is None:
            self._parse_all()
            return self._values[key]
        try:
            member = doc[key]
        except KeyError:  # a key simdjson cannot look up: the full parse has it
            self._parse_all()
            return self._values[key]
        value = self._values[key] = _plain(member)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self._keys else default

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def array_items(self, key: str) -> Iterator[Any] | None:
        """The elements of array member ``key``, each converted when reached (none when the member
        is absent); None when it is not an array."""
        value = self._values.get(key, _MISSING)
        if value is _MISSING:
            if key not in self._keys:
                return iter(())
            if self._doc is None:
                value = self[key]
            else:
                member = self._doc[key]
                if not isinstance(member, simdjson.Array):
                    return None
                return map(_plain, member)
        return iter(value) if isinstance(value, list) else None

    def settle(self) -> None:
        """Let simdjson's buffers go; members not read yet come from a full parse when read."""
        self._doc = None
        parser, self._parser = self._parser, None
        if parser is not None and len(self._raw) <= POOLED_UP_TO and len(_POOL) < POOL_SIZE:
            _POOL.append(parser)

    def _parse_all(self) -> None:
        values = self._values
        for key, value in orjson.loads(self._raw).items():
            values.setdefault(key, value)


def messages_object(raw: bytes) -> tuple[LazyObject, int] | None:
    """``raw`` as a LazyObject and its number of ``messages`` when it is a JSON object whose
    ``messages`` member is an array of objects (0: absent, empty or anything else); None when simdjson
    rejects it or it repeats a key (the eager parser then decides: its error, its last-wins keys)."""
    try:
        parser, doc = _parse(raw)
    except (ValueError, RuntimeError):
        return None
    if not isinstance(doc, simdjson.Object):
        return None
    keys = list(doc.keys())
    unique = frozenset(keys)
    if len(unique) != len(keys) or any("\x00" in key for key in keys):  # NUL: not a lookup key there
        return None
    count = 0
    if "messages" in unique:
        messages = doc["messages"]
        if isinstance(messages, simdjson.Array) and all(isinstance(m, simdjson.Object) for m in messages):
            count = len(messages)
    return LazyObject(raw, parser, doc, unique), count
