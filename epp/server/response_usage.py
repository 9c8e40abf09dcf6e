"""Token usage read from a model server's response body, for the response-body plugins.

A JSON response's ``usage`` object is read at its end; an event stream's ``data:`` events carrying
``usage`` are merged as they come (OpenAI's final usage chunk; Anthropic's ``message_start`` and
``message_delta`` split it). Field names are OpenAI's: Anthropic's ``input_tokens`` /
``output_tokens`` / ``cache_read_input_tokens`` count as prompt, completion and cached tokens.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["MAX_JSON_BODY_BYTES", "UsageReader"]

MAX_JSON_BODY_BYTES = 16 << 20  # a larger non-streamed body is not kept for its usage


def _count(block: dict[str, Any], *names: str) -> int:
    for name in names:
        v = block.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


class UsageReader:
    """Feeds on one response's body chunks; ``usage`` is the merged usage (None until one is seen)."""

    __slots__ = ("_json", "_json_size", "_line", "streaming", "usage")

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.usage: dict[str, Any] | None = None
        self._line = b""  # an event-stream line not yet terminated
        self._json: list[bytes] | None = [] if not streaming else None
        self._json_size = 0

    def feed(self, chunk: bytes, end_of_stream: bool) -> None:
        if self.streaming:
            self._feed_events(chunk, end_of_stream)
            return
        parts = self._json
        if parts is None:
            return
        if chunk:
            self._json_size += len(chunk)
            if self._json_size > MAX_JSON_BODY_BYTES:
                self._json = None
                return
            parts.append(chunk)
        if end_of_stream:
            self._json = None
            try:
                doc = orjson.loads(b"".join(parts))
            except orjson.JSONDecodeError:
                return
            if isinstance(doc, dict):
                self._merge(doc.get("usage"))

    def _feed_events(self, chunk: bytes, end_of_stream: bool) -> None:
        data = self._line + chunk if self._line else chunk
        lines = data.split(b"\n")
        self._line = b"" if end_of_stream else lines.pop()
        if len(self._line) > MAX_JSON_BODY_BYTES:
            self._line = b""
        for line in lines:
            if b'"usage"' not in line:
                continue
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(event, dict):
                continue
            self._merge(event.get("usage"))
            message = event.get("message")  # Anthropic message_start
            if isinstance(message, dict):
                self._merge(message.get("usage"))

    def _merge(self, block: Any) -> None:
        """Fold one usage block in: each field is taken from the blocks that report it."""
        if not isinstance(block, dict):
            return
        usage = self.usage
        if usage is None:
            usage = self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        prompt = _count(block, "prompt_tokens", "input_tokens")
        completion = _count(block, "completion_tokens", "output_tokens")
        total = _count(block, "total_tokens")
        if prompt:
            usage["prompt_tokens"] = prompt
        if completion:
            usage["completion_tokens"] = completion
        details = block.get("prompt_tokens_details")
        if isinstance(details, dict):
            usage["prompt_tokens_details"] = {"cached_tokens": _count(details, "cached_tokens")}
        elif "cache_read_input_tokens" in block:
            usage["prompt_tokens_details"] = {"cached_tokens": _count(block, "cache_read_input_tokens")}
        if prompt and completion and total:
            usage["total_tokens"] = total
        else:
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
