"""The simulator's stand-in tokenizer: about four characters per token, deterministic and model-free."""

from __future__ import annotations

import math
from collections.abc import Iterable

CHARS_PER_TOKEN = 4
"""Token estimate used for prompts given as text: about four characters per token."""

CHAT_MESSAGE_OVERHEAD = 3
"""Tokens a chat template adds around every message (start marker, role, end marker)."""


def estimate_tokens(text: str) -> int:
    """Approximate token count of a text (four characters per token, rounded up)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def text_tokens(text: str) -> list[str]:
    """The tokens of a text: its consecutive four-character pieces."""
    return [text[start : start + CHARS_PER_TOKEN] for start in range(0, len(text), CHARS_PER_TOKEN)]


def id_tokens(ids: Iterable[int]) -> list[str]:
    """Tokens given as ids by the client, in the same key space as text tokens (no collisions)."""
    return [f"\x00{token_id}" for token_id in ids]


def chat_tokens(messages: Iterable[tuple[str, str]]) -> list[str]:
    """The tokens of a chat prompt given as ``(role, content)`` pairs: per message, a small fixed
    overhead (the role markers a chat template adds), then the content's tokens."""
    tokens: list[str] = []
    for role, content in messages:
        tokens.extend(("\x00<|start|>", f"\x00{role}", "\x00<|sep|>"))
        tokens.extend(text_tokens(content))
    return tokens
