"""A HF tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) loaded for prompt
tokenization: plain encoding, completions prompts (special tokens as the config says), chat prompts
(the config's chat template), decoding, and ``encode_cached`` for long multi-turn prompts.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from epp.tokenization._segment_cache import DEFAULT_CACHE_BYTES, SegmentCache
from epp.tokenization._segments import splitter_for
from epp.tokenization.chat_template import ChatTemplate, ChatTemplateError

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / "epp-bpe-8k"
"""The small byte-level BPE tokenizer shipped with epp (ChatML chat template)."""

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip


_GIL_FREE_CHARS = 16 * 1024


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded: the path and the reason."""


class Tokenizer:
    """One loaded tokenizer. ``encode`` adds no special tokens (a chat template writes them);
    ``prompt_ids`` adds what the model adds to a completions prompt. Thread-safe."""

    __slots__ = (
        "_cache",
        "_hf",
        "_prefix",
        "_splitter",
        "_suffix",
        "_templates",
        "clean_up_spaces",
        "path",
        "special_tokens",
    )

    def __init__(
        self,
        hf: HFTokenizer,
        config: Mapping[str, Any] | None = None,
        *,
        path: Path | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        config = dict(config or {})
        hf.no_truncation()
        hf.no_padding()
        self._hf = hf
        self.path = path
        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._prefix, self._suffix = self._special_affixes(config)
        self._splitter = splitter_for(hf)
        self._cache = SegmentCache(cache_bytes)
        sources = _templates(chat_template if chat_template is not None else config.get("chat_template"))
        self._templates = {name: ChatTemplate(source) for name, source in sources.items()}

    # ------------------------------------------------------------------ plain text

    @property
    def vocab_size(self) -> int:
        return int(self._hf.get_vocab_size(with_added_tokens=True))

    @property
    def cache(self) -> SegmentCache:
        """The segment cache behind :meth:`encode_cached`."""
        return self._cache

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``; added tokens written in it are recognized, none are added.

        A long text goes through ``encode_batch``, which releases the GIL while it tokenizes (plain
        ``encode`` holds it), so a worker thread tokenizing a long prompt does not stall the loop.
        """
        if len(text) >= _GIL_FREE_CHARS:
            return list(self._hf.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        text = str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))
        if self.clean_up_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of some ids (HF ``convert_ids_to_tokens``; ``""`` for unknown ids)."""
        return [self._hf.id_to_token(i) or "" for i in ids]

    def token_id(self, token: str) -> int | None:
        found = self._hf.token_to_id(token)
        return None if found is None else int(found)

    def encode_cached(self, text: str) -> list[int]:
        """``encode(text)``, tokenizing only the segments between added tokens not seen recently."""
        splitter = self._splitter
        if splitter is None:
            return self.encode(text)
        pieces = list(splitter.pieces(text))
        found: dict[str, array[int]] = {}
        missing: list[str] = []
        for piece in pieces:
            if isinstance(piece, str) and piece not in found:
                ids = self._cache.get(piece)
                if ids is None:
                    missing.append(piece)
                    found[piece] = array("I")
                else:
                    found[piece] = ids
        if missing:
            for piece, encoding in zip(
                missing, self._hf.encode_batch(missing, add_special_tokens=False), strict=True
            ):
                ids = array("I", encoding.ids)
                found[piece] = ids
                self._cache.put(piece, ids)
        result = array("I")  # array-to-array extends are copies; one tolist() makes the ints
        for piece in pieces:
            if isinstance(piece, int):
                result.append(piece)
            else:
                result.extend(found[piece])
        return result.tolist()

    def prompt_ids(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """A completions prompt: what the model adds around a prompt (e.g. BOS), then its ids."""
        ids = self.encode_cached(prompt)
        return self.with_special_tokens(ids) if add_special_tokens else ids

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """``ids`` with the special tokens the model adds around one sequence."""
        if not (self._prefix or self._suffix):
            return ids
        return [*self._prefix, *ids, *self._suffix]

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[Any] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat (the chat template with the special tokens and the request's
        ``chat_template_kwargs``, which cannot override ``messages``, ``tools`` or the generation
        prompt). Raises :class:`ChatTemplateError`."""
        template = self._chat_template(bool(tools))
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(chat_template_kwargs or {})
        return template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, variables=variables
        )

    def chat_ids(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[Any] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The ids of a rendered chat (no special tokens added beyond what the template writes)."""
        text = self.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode_cached(text)

    def _chat_template(self, with_tools: bool) -> ChatTemplate:
        if not self._templates:
            raise ChatTemplateError("the tokenizer has no chat template")
        name = "tool_use" if with_tools and "tool_use" in self._templates else "default"
        return self._templates.get(name) or next(iter(self._templates.values()))

    def _special_affixes(self, config: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids added before and after one sequence: from ``add_bos_token``/``add_eos_token`` when the
        config has them, else from the tokenizer's own post-processor."""
        if "add_bos_token" in config or "add_eos_token" in config:
            prefix = self._config_token(config, "bos_token") if config.get("add_bos_token") else ()
            suffix = self._config_token(config, "eos_token") if config.get("add_eos_token") else ()
            return prefix, suffix
        probe = "a"
        plain = list(self._hf.encode(probe, add_special_tokens=False).ids)
        full = list(self._hf.encode(probe, add_special_tokens=True).ids)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain) :])
        return (), ()

    def _config_token(self, config: Mapping[str, Any], name: str) -> tuple[int, ...]:
        content = _token_content(config.get(name))
        token_id = None if content is None else self._hf.token_to_id(content)
        return () if token_id is None else (int(token_id),)


def load_tokenizer(path: str | Path, *, cache_bytes: int = DEFAULT_CACHE_BYTES) -> Tokenizer:
    """Load a HF tokenizer: a directory with ``tokenizer.json`` (and optionally ``tokenizer_config.json``
    and ``chat_template.jinja``), or a ``tokenizer.json`` file. Raises :class:`TokenizerError`."""
    given = _shipped(Path(path))
    directory, file = (given, given / "tokenizer.json") if given.is_dir() else (given.parent, given)
    if not file.is_file():
        raise TokenizerError(f"{given}: no tokenizer.json there")
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise TokenizerError(f"{file}: not a tokenizer.json: {exc}") from None
    config = _read_json(directory / "tokenizer_config.json")
    template: str | None = None
    jinja_file = directory / "chat_template.jinja"
    if not config.get("chat_template") and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    try:
        return Tokenizer(hf, config, path=directory, chat_template=template, cache_bytes=cache_bytes)
    except ChatTemplateError as exc:
        raise TokenizerError(f"{directory}: {exc}") from None


def _shipped(given: Path) -> Path:
    """A bare name of a tokenizer shipped with epp (``epp-bpe-8k``, the simulators' tokenizer) names
    its directory from any working directory, unless a path of that name exists here."""
    shipped = DEFAULT_TOKENIZER_DIR.parent / given.name
    if len(given.parts) == 1 and not given.exists() and shipped.is_dir():
        return shipped
    return given


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerError(f"{file}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: must be a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an ``AddedToken`` object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _templates(value: Any) -> dict[str, str]:
    """The chat templates by name: a single template is ``default``; a list holds named ones."""
    if isinstance(value, str):
        return {"default": value} if value else {}
    if isinstance(value, list):
        named = {
            str(item["name"]): str(item["template"])
            for item in value
            if isinstance(item, dict) and "name" in item and "template" in item
        }
        return named
    return {}
