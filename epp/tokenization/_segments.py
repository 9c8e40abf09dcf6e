"""Splitting a text at its added (special) tokens exactly where HF ``tokenizers`` splits it.

``tokenizers`` first cuts the text at the non-normalized added tokens (leftmost-longest matches),
then tokenizes every piece on its own. Cutting at the same places and encoding the pieces
separately therefore gives the same ids, so the pieces can be cached. Tokens that strip the
whitespace around them or must be whole words are matched (they decide where the other matches
fall) but not cut at.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


class Splitter:
    """Yields a text as pieces: ``str`` segments to tokenize and ``int`` ids of split tokens."""

    __slots__ = ("_ids", "_pattern")

    def __init__(self, pattern: re.Pattern[str], ids: dict[str, int]) -> None:
        self._pattern = pattern
        self._ids = ids

    def pieces(self, text: str) -> Iterator[str | int]:
        start = 0
        ids = self._ids
        for match in self._pattern.finditer(text):
            token_id = ids.get(match.group())
            if token_id is None:
                continue
            if match.start() > start:
                yield text[start : match.start()]
            yield token_id
            start = match.end()
        if start < len(text):
            yield text[start:]


def splitter_for(tokenizer: HFTokenizer) -> Splitter | None:
    """The splitter of a tokenizer, or ``None`` when pieces cannot be encoded on their own (a
    Metaspace pre-tokenizer that prefixes only the first piece) or it has nothing to split at."""
    if _prefixes_first_piece_only(json.loads(tokenizer.to_str()).get("pre_tokenizer")):
        return None
    matched: list[str] = []
    ids: dict[str, int] = {}
    has_single_word = False
    for token_id, token in tokenizer.get_added_tokens_decoder().items():
        if token.normalized or not token.content:
            continue
        matched.append(token.content)
        has_single_word = has_single_word or token.single_word
        if not (token.lstrip or token.rstrip or token.single_word):
            ids[token.content] = token_id
    if has_single_word:  # a whole-word token next to a cut must see the same neighbours
        ids = {
            content: i for content, i in ids.items() if not (content[0].isalnum() or content[-1].isalnum())
        }
    if not ids:
        return None
    alternatives = sorted(set(matched), key=lambda content: (-len(content), content))
    return Splitter(re.compile("|".join(re.escape(content) for content in alternatives)), ids)


def _prefixes_first_piece_only(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return True
        return any(_prefixes_first_piece_only(child) for child in node.get("pretokenizers") or ())
    return False
