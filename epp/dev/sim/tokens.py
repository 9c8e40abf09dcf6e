"""The simulator's tokenizer: one :mod:`epp.tokenization` tokenizer per path, shared by every rank
of the process (so its segment cache is too), and the deterministic text the engine generates."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from epp.tokenization import DEFAULT_TOKENIZER_DIR, Tokenizer, load_tokenizer

OUTPUT_TEXT = (
    "The quick brown fox jumps over the lazy dog. A simulated model server answers every request politely, "
)
"""What the simulated model says, over and over (as many tokens as the request gets)."""


@functools.cache
def tokenizer_for(path: str = "") -> Tokenizer:
    """The tokenizer at ``path`` (``""``: the one shipped with epp), loaded once per process."""
    return load_tokenizer(Path(path) if path else DEFAULT_TOKENIZER_DIR)


@dataclass(slots=True, frozen=True)
class OutputTokens:
    """The generated tokens' ids and the text each adds to the answer (cycled)."""

    ids: tuple[int, ...]
    texts: tuple[str, ...]

    def at(self, index: int) -> tuple[int, str]:
        position = index % len(self.ids)
        return self.ids[position], self.texts[position]


@functools.cache
def output_tokens(tokenizer: Tokenizer) -> OutputTokens:
    """:data:`OUTPUT_TEXT` tokenized; each token's text is what decoding it adds to the ones before."""
    ids = tokenizer.encode(OUTPUT_TEXT)
    texts: list[str] = []
    decoded = ""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end])
        texts.append(text[len(decoded) :])
        decoded = text
    return OutputTokens(tuple(ids), tuple(texts))
