"""Build the tokenizer shipped in the package (``data/epp-bpe-8k``): a byte-level BPE of about 8k
tokens trained with HF ``tokenizers`` on text available offline (the Python standard library's
top-level modules: code, English docstrings and comments), with a ChatML chat template.

``python -m epp.tokenization.build_asset [--out DIR]``. Training is deterministic: the corpus is
read in sorted path order and the trainer breaks ties by token id, so the same Python version (the
shipped asset: CPython 3.11.7) gives the same files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from epp.tokenization.chatml import CHATML_TEMPLATE, END, ENDOFTEXT, START

VOCAB_SIZE = 8192
SPECIAL_TOKENS = (ENDOFTEXT, START, END)
DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "epp-bpe-8k"
_STDLIB_MAX_BYTES = 6 * 1024 * 1024


def corpus_files(stdlib: Path | None = None) -> list[Path]:
    """The training files: the standard library's top-level modules, sorted, up to 6 MiB."""
    files: list[Path] = []
    std_root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    budget = _STDLIB_MAX_BYTES
    for path in sorted(std_root.glob("*.py")):
        size = path.stat().st_size
        if size <= budget:
            files.append(path)
            budget -= size
    return files


def _texts(files: Sequence[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train(files: Sequence[Path], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenization) with the ChatML special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(files), trainer=trainer, length=len(files))
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """The ``tokenizer_config.json`` of the asset (HF layout: special tokens and the chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }


def build(out: Path, files: Sequence[Path] | None = None) -> dict[str, str]:
    """Train and write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``; returns their
    sha256 digests."""
    corpus = list(files) if files is not None else corpus_files()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train(corpus)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest()
        for name in ("tokenizer.json", "tokenizer_config.json")
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epp.tokenization.build_asset", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: the asset)")
    args = parser.parse_args(argv)
    for name, digest in build(args.out).items():
        print(f"{digest}  {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
