"""Real tokenization for the simulator and the EPP: HF ``tokenizers`` + Jinja2 chat templates.

``load_tokenizer(path)`` loads a HF tokenizer directory; ``DEFAULT_TOKENIZER_DIR`` is the small
byte-level BPE shipped in the package (``data/epp-bpe-8k``, built by ``build_asset``, ChatML chat
template from ``chatml``). ``tokenizer`` holds the :class:`Tokenizer`, ``chat_template`` the
template rendering, ``_segments`` and ``_segment_cache`` the cached encoding of long prompts;
``requests`` turns OpenAI request bodies into ids as vLLM does (``completion_prompts``,
``chat_prompt``).
"""

from epp.tokenization.chat_template import ChatTemplateError
from epp.tokenization.requests import PromptError, chat_prompt, completion_prompts
from epp.tokenization.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "DEFAULT_TOKENIZER_DIR",
    "ChatTemplateError",
    "PromptError",
    "Tokenizer",
    "TokenizerError",
    "chat_prompt",
    "completion_prompts",
    "load_tokenizer",
]
