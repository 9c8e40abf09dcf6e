"""Tokenization cost of a long multi-turn chat, cold vs warm (``python bench/tokenize_cache.py``).

A conversation of about ``--kb`` KB (agentic turns: tool calls and long tool outputs) is rendered
with the shipped ChatML template; the next turn adds one user message (the body stays 90%+ the
same). Reported per size: ``encode`` (no cache), ``encode_cached`` on a cold cache, and
``encode_cached`` on the next turn after the previous one was tokenized (warm), as medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epp.tokenization import DEFAULT_TOKENIZER_DIR, load_tokenizer

_WORDS = [
    "def",
    "return",
    "import",
    "self",
    "None",
    "value",
    "result",
    "error",
    "file",
    "path",
    "line",
    "config",
    "request",
    "token",
    "cache",
    "block",
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "for",
    "with",
    "that",
    "this",
    "on",
    "by",
    "as",
    "be",
    "are",
    "from",
]


def conversation(kb: int, seed: int = 1) -> list[dict[str, Any]]:
    """Turns until the JSON-free rendered size passes ``kb`` KB: user asks, assistant calls a tool,
    the tool answers with a long output."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 20}]
    size = 0
    turn = 0
    while size < kb * 1024:
        output = "\n".join(" ".join(rng.choices(_WORDS, k=12)) for _ in range(rng.randint(20, 60)))
        turn_messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"Step {turn}: " + " ".join(rng.choices(_WORDS, k=30))},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{turn}",
                        "type": "function",
                        "function": {"name": "run", "arguments": '{"cmd": "ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c{turn}", "content": output},
        ]
        messages += turn_messages
        size += sum(len(m["content"] or "") for m in turn_messages)
        turn += 1
    return messages


def _median_ms(function: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(kb: int, repeat: int) -> dict[str, float]:
    tok = load_tokenizer(DEFAULT_TOKENIZER_DIR)
    turn = conversation(kb)
    text = tok.render_chat(turn)
    following = tok.render_chat([*turn, {"role": "user", "content": "Now run the tests and fix what fails."}])
    assert tok.encode_cached(following) == tok.encode(following)

    def cold() -> None:
        tok.cache.clear()
        tok.encode_cached(text)

    def warm() -> None:
        tok.cache.clear()
        tok.encode_cached(text)  # the previous turn, outside the timing below
        start = time.perf_counter()
        tok.encode_cached(following)
        warm_times.append((time.perf_counter() - start) * 1000)

    warm_times: list[float] = []
    for _ in range(repeat):
        warm()
    return {
        "bytes": len(text.encode()),
        "tokens": len(tok.encode(text)),
        "encode_ms": _median_ms(lambda: tok.encode(text), repeat),
        "cold_ms": _median_ms(cold, repeat),
        "warm_ms": statistics.median(warm_times),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kb", type=int, nargs="+", default=[200, 800], help="conversation sizes in KB")
    parser.add_argument("--repeat", type=int, default=7, help="runs per figure (the median is printed)")
    args = parser.parse_args()
    print(f"{'size':>8} {'tokens':>8} {'encode ms':>10} {'cold ms':>9} {'warm ms':>9} {'speed-up':>9}")
    for kb in args.kb:
        r = measure(kb, args.repeat)
        speedup = r["encode_ms"] / r["warm_ms"]
        print(
            f"{r['bytes'] / 1024:>6.0f}KB {r['tokens']:>8.0f} {r['encode_ms']:>10.2f} {r['cold_ms']:>9.2f}"
            f" {r['warm_ms']:>9.2f} {speedup:>8.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
