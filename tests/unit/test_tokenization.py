"""``epp.tokenization``: the shipped BPE, chat templates rendered as HF transformers does,
completions prompts, and ``encode_cached`` (same ids as ``encode``, bounded segment cache)."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers, processors, trainers

from epp.tokenization import (
    DEFAULT_TOKENIZER_DIR,
    ChatTemplateError,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)
from epp.tokenization.build_asset import build

TOK = load_tokenizer(DEFAULT_TOKENIZER_DIR)
SMALL_CACHE = load_tokenizer(DEFAULT_TOKENIZER_DIR, cache_bytes=64)  # tiny: evictions happen too
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def _copy_asset(tmp_path: Path, **config: object) -> Path:
    directory = tmp_path / "tok"
    shutil.copytree(DEFAULT_TOKENIZER_DIR, directory)
    if config:
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return directory


# ---------------------------------------------------------------------- the shipped asset


def test_shipped_asset_is_a_small_real_bpe_with_the_chatml_specials() -> None:
    files = {p.name: p.stat().st_size for p in DEFAULT_TOKENIZER_DIR.iterdir()}
    assert set(files) >= {"tokenizer.json", "tokenizer_config.json"}
    assert sum(files.values()) < 1024 * 1024
    assert TOK.vocab_size == 8192
    assert [TOK.token_id(s) for s in SPECIALS] == [1, 2, 0]
    assert TOK.encode("<|im_start|>user\n") == [1, TOK.encode("user")[0], *TOK.encode("\n")]
    ids = TOK.encode("The tokenizer merges frequent byte pairs.")
    assert len(ids) < len("The tokenizer merges frequent byte pairs.") / 2  # real merges, not bytes
    assert TOK.token_strs(TOK.encode(" return")) == ["Ġreturn"]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_decode_inverts_encode_for_any_unicode(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


def test_build_is_deterministic(tmp_path: Path) -> None:
    corpus = sorted(Path(__file__).parent.glob("test_t*.py"))
    first = build(tmp_path / "a", corpus)
    second = build(tmp_path / "b", corpus)
    assert first == second
    assert load_tokenizer(tmp_path / "a").encode("<|im_end|>") == [2]


# ---------------------------------------------------------------------- chat templates

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_chatml_render_matches_hand_checked_text() -> None:
    assert TOK.render_chat(CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert TOK.render_chat(CHAT, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    )
    assert TOK.chat_ids(CHAT) == TOK.encode(TOK.render_chat(CHAT))
    assert TOK.chat_ids(CHAT)[-3:] != TOK.chat_ids(CHAT, add_generation_prompt=False)[-3:]


def test_chatml_tools_tool_calls_and_content_parts() -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "Zürich"}}}]
    messages = [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "weather", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    assert TOK.render_chat(messages, tools=tools) == (
        "<|im_start|>system\nS\n\n# Tools\n\n<tools>\n"
        '{"type": "function", "function": {"name": "weather", "parameters": {"city": "Zürich"}}}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n"
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "weather", "arguments": {"x": 1}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _with_template(tmp_path: Path, template: object, **config: object) -> Tokenizer:
    return load_tokenizer(_copy_asset(tmp_path, chat_template=template, **config))


def test_hf_template_features(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m.role == 'stop' %}{% break %}{% endif %}\n"
        "  {% generation %}[{{ m.role }}:{{ m.content | tojson }}]{% endgeneration %}\n"
        "{% endfor %}{{ flavour }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}"
    )
    tok = _with_template(tmp_path, template, bos_token="<|endoftext|>")
    messages = [{"role": "user", "content": "héllo"}, {"role": "stop", "content": ""}, {"role": "x"}]
    rendered = tok.render_chat(messages, chat_template_kwargs={"flavour": "mint"})
    # trim_blocks + lstrip_blocks: no stray newlines or indentation; tojson keeps non-ASCII
    assert rendered == '<|endoftext|>[user:"héllo"]mint|4|<|im_end|>'


def test_raise_exception_and_broken_templates_are_chat_template_errors(tmp_path: Path) -> None:
    tok = _with_template(tmp_path, "{{ raise_exception('only user messages') }}")
    with pytest.raises(ChatTemplateError, match="only user messages"):
        tok.render_chat(CHAT)
    sandboxed = _with_template(tmp_path / "s", "{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render_chat(CHAT)
    with pytest.raises(TokenizerError, match="does not compile"):
        _with_template(tmp_path / "b", "{% for %}").render_chat(CHAT)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _with_template(tmp_path / "n", None).render_chat(CHAT)


def test_template_iterating_content_gets_text_parts(tmp_path: Path) -> None:
    template = "{% for m in messages %}{% for p in m['content'] %}<{{ p.text }}>{% endfor %}{% endfor %}"
    tok = _with_template(tmp_path, template)
    assert (
        tok.render_chat(
            [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "y"}]}]
        )
        == "<x><y>"
    )


def test_named_templates_pick_tool_use_with_tools(tmp_path: Path) -> None:
    tok = _with_template(
        tmp_path, [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    )
    assert tok.render_chat(CHAT) == "D"
    assert tok.render_chat(CHAT, tools=[{"type": "function"}]) == "T"


def test_chat_template_jinja_file_is_used(tmp_path: Path) -> None:
    directory = _copy_asset(tmp_path, chat_template=None)
    (directory / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_tokenizer(directory).render_chat(CHAT) == "J2"


# ---------------------------------------------------------------------- completions prompts


def test_prompt_ids_follow_add_bos_token(tmp_path: Path) -> None:
    assert TOK.prompt_ids("hello") == TOK.encode("hello")  # ChatML asset: no BOS
    tok = load_tokenizer(_copy_asset(tmp_path, bos_token={"content": "<|endoftext|>"}, add_bos_token=True))
    assert tok.prompt_ids("hello") == [0, *TOK.encode("hello")]
    assert tok.prompt_ids("hello", add_special_tokens=False) == TOK.encode("hello")


def test_prompt_ids_follow_the_post_processor_without_config(tmp_path: Path) -> None:
    hf = HFTokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.prompt_ids("hello") == [1, *TOK.encode("hello"), 2]
    assert not tok.has_chat_template


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        load_tokenizer(tmp_path)
    directory = _copy_asset(tmp_path)
    (directory / "tokenizer_config.json").write_text("[")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not JSON"):
        load_tokenizer(directory)


# ---------------------------------------------------------------------- encode_cached

_PIECES = st.one_of(
    st.sampled_from([*SPECIALS, "<|im_", "im_end|>", "<|", "|>", " ", "\n", "user\n", "  \n "]),
    st.text(max_size=40),
)
_TEXTS = st.lists(_PIECES, max_size=24).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXTS, min_size=1, max_size=4))
def test_encode_cached_equals_encode(texts: list[str]) -> None:
    tok = SMALL_CACHE
    tok.cache.clear()
    for text in texts:
        assert tok.encode_cached(text) == tok.encode(text)
        assert tok.encode_cached(text) == tok.encode(text)  # warm
        assert tok.cache.bytes <= 64


@functools.cache
def _metaspace(scheme: str) -> Tokenizer:
    tmp_path = Path(tempfile.mkdtemp(prefix="metaspace"))
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.normalizer = normalizers.NFKC()
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    hf.train_from_iterator(["hello world, the user said hello", "ünïcode text ﬁ"] * 5, trainer=trainer)
    hf.save(str(tmp_path / f"{scheme}.json"))
    return load_tokenizer(tmp_path / f"{scheme}.json")


@settings(max_examples=100, deadline=None)
@given(_TEXTS)
def test_encode_cached_equals_encode_for_metaspace_tokenizers(text: str) -> None:
    for scheme in ("always", "first"):
        tok = _metaspace(scheme)
        assert tok.encode_cached(text) == tok.encode(text), scheme


def _conversation(turns: int, size: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"turn {i}: " + "lorem ipsum dolor " * (size // 18),
        }
        for i in range(turns)
    ]


def test_next_turn_only_tokenizes_new_segments() -> None:
    tok = load_tokenizer(DEFAULT_TOKENIZER_DIR)
    first = _conversation(10, 2000)
    tok.chat_ids(first)
    misses = tok.cache.misses
    assert misses == 12  # ten messages, the "\n" between them and the generation prompt's "assistant\n"
    second = [*first, {"role": "user", "content": "and one more question"}]
    assert tok.chat_ids(second) == tok.encode(tok.render_chat(second))
    assert tok.cache.misses - misses == 1  # only the new message was tokenized


def test_segment_cache_is_bounded_by_bytes_least_recent_first() -> None:
    tok = load_tokenizer(DEFAULT_TOKENIZER_DIR, cache_bytes=100)
    tok.encode_cached("a" * 40 + "<|im_end|>" + "b" * 40)
    assert tok.cache.bytes == 80
    tok.encode_cached("a" * 40)  # touched: now the most recent
    tok.encode_cached("c" * 40)  # evicts the least recent ("b" * 40)
    assert tok.cache.bytes == 80
    assert "a" * 40 in tok.cache and "c" * 40 in tok.cache and "b" * 40 not in tok.cache
    tok.encode_cached("é" * 60)  # 120 bytes: larger than the bound, never cached
    assert "é" * 60 not in tok.cache and tok.cache.bytes <= 100


def test_the_asset_is_package_data() -> None:
    """A non-editable install (the image) ships the asset: pyproject's package-data globs cover it."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["epp"]
    for file in DEFAULT_TOKENIZER_DIR.iterdir():
        relative = file.relative_to(root / "epp")
        assert any(relative.match(glob) for glob in globs), relative


def test_request_bodies_become_the_ids_vllm_would_use() -> None:
    from epp.tokenization.requests import PromptError, chat_prompt, completion_prompts

    assert completion_prompts({"prompt": "hi"}, TOK) == [TOK.prompt_ids("hi")]
    assert completion_prompts({"prompt": ["a", "b"]}, TOK) == [TOK.encode("a"), TOK.encode("b")]
    assert completion_prompts({"prompt": [[1, 2], [3]]}, TOK) == [[1, 2], [3]]
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "tools": []}
    assert chat_prompt(body, TOK) == TOK.encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")
    kwargs_body = {**body, "add_generation_prompt": False}
    assert chat_prompt(kwargs_body, TOK) == TOK.encode("<|im_start|>user\nx<|im_end|>\n")
    for bad, param in (
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [TOK.vocab_size]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
    ):
        with pytest.raises(PromptError) as caught:
            completion_prompts(bad, TOK)
        assert caught.value.param == param
    with pytest.raises(PromptError, match="non-empty list"):
        chat_prompt({"messages": []}, TOK)


def test_the_shipped_tokenizer_loads_by_name_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import epp.tokenization as tokenization

    monkeypatch.chdir(tmp_path)
    by_name = tokenization.load_tokenizer("epp-bpe-8k")
    shipped = tokenization.load_tokenizer(tokenization.DEFAULT_TOKENIZER_DIR)
    assert by_name.encode("hello world") == shipped.encode("hello world")
    (tmp_path / "epp-bpe-8k").mkdir()  # a directory of that name here wins (and has no tokenizer)
    with pytest.raises(tokenization.TokenizerError, match=r"no tokenizer\.json"):
        tokenization.load_tokenizer("epp-bpe-8k")
