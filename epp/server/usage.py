"""Token usage read from response bodies the EPP sees (OpenAI and Anthropic field names).

``UsageReader.feed(chunk)`` per response-body chunk: only a chunk holding ``"usage"`` is parsed
(just that object), so a streamed generation costs one substring test per chunk. Fields reported by
several events (Anthropic splits them) are merged; the last value of each wins. ``usage`` gives the
merged counts under OpenAI's field names (what response-body plugins see).
"""

from __future__ import annotations

from typing import Any

import orjson

_KEY = b'"usage"'
_SPACE = frozenset(b" \t\r\n")
_MAX_TAIL = 4096  # an unfinished usage object carried into the next chunk, at most


def _object_end(data: bytes, start: int) -> int:
    """Index after the JSON object starting at ``data[start] == '{'``; -1 if it is cut off."""
    depth = 0
    in_string = False
    i, n = start, len(data)
    while i < n:
        c = data[i]
        if in_string:
            if c == 0x5C:  # backslash: skip the escaped byte
                i += 1
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class UsageReader:
    """Accumulates ``prompt``, ``completion`` and ``cached`` token counts from a response body."""

    __slots__ = ("_merged", "_tail", "cached", "cached_seen", "completion", "prompt", "raw", "total")

    def __init__(self) -> None:
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.total = 0
        self.cached_seen = False  # a cached-token count was reported (even 0)
        self.raw: dict[str, Any] | None = None  # the last usage object seen
        self._tail = b""
        self._merged: dict[str, Any] | None = None

    @property
    def usage(self) -> dict[str, Any] | None:
        """The merged usage in OpenAI's field names; None until a usage object was seen."""
        if self.raw is None:
            return None
        merged = self._merged
        if merged is None:
            total = (
                self.total
                if self.prompt and self.completion and self.total
                else self.prompt + self.completion
            )
            merged = {
                "prompt_tokens": self.prompt,
                "completion_tokens": self.completion,
                "total_tokens": total,
            }
            if self.cached_seen:
                merged["prompt_tokens_details"] = {"cached_tokens": self.cached}
            self._merged = merged
        return merged

    def feed(self, chunk: bytes) -> None:
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        elif _KEY not in chunk:
            return
        pos = 0
        while True:
            i = chunk.find(_KEY, pos)
            if i < 0:
                return
            j, n = i + len(_KEY), len(chunk)
            while j < n and chunk[j] in _SPACE:
                j += 1
            if j < n and chunk[j] == 0x3A:  # ':'
                j += 1
                while j < n and chunk[j] in _SPACE:
                    j += 1
            if j >= n:  # cut off before the value
                self._keep(chunk[i:])
                return
            if chunk[j] != 0x7B:  # null, or "usage" as some other key's value
                pos = j
                continue
            end = _object_end(chunk, j)
            if end < 0:
                self._keep(chunk[i:])
                return
            self._merge(chunk[j:end])
            pos = end

    def _keep(self, tail: bytes) -> None:
        if len(tail) <= _MAX_TAIL:
            self._tail = tail

    def _merge(self, text: bytes) -> None:
        try:
            usage = orjson.loads(text)
        except orjson.JSONDecodeError:
            return
        if not isinstance(usage, dict):
            return
        self.raw = usage
        self._merged = None
        prompt = _int(usage.get("prompt_tokens")) or _int(usage.get("input_tokens"))
        completion = _int(usage.get("completion_tokens")) or _int(usage.get("output_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        cached = cached or _int(usage.get("cache_read_input_tokens"))
        if isinstance(details, dict) or "cache_read_input_tokens" in usage:
            self.cached_seen = True
        total = _int(usage.get("total_tokens"))
        if total:
            self.total = total
        if prompt:
            self.prompt = prompt
        if completion:
            self.completion = completion
        if cached:
            self.cached = cached
