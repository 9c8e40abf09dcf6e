"""OpenAI request bodies as token ids, as vLLM reads them: a completions ``prompt`` (text, texts,
ids or lists of ids; ``add_special_tokens``) and a chat's ``messages`` rendered by the chat template
(``tools``, ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
``add_special_tokens``). The simulator and the EPP's local token producer both use these, so the
same request gets the same ids."""

from __future__ import annotations

from typing import Any

from epp.tokenization.chat_template import ChatTemplateError
from epp.tokenization.tokenizer import Tokenizer


class PromptError(ValueError):
    """A request whose prompt cannot be tokenized; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def completion_prompts(body: dict[str, Any], tokenizer: Tokenizer) -> list[list[int]]:
    """One list of ids per prompt of a completions request (``add_special_tokens`` defaults to true)."""
    prompt = body.get("prompt")
    special = _flag(body, "add_special_tokens", default=True)
    if isinstance(prompt, str):
        return [tokenizer.prompt_ids(prompt, add_special_tokens=special)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return [tokenizer.prompt_ids(item, add_special_tokens=special) for item in prompt]
        if all(_is_int(item) for item in prompt):
            return [checked_ids(prompt, tokenizer, "prompt")]
        if all(isinstance(item, list) and item and all(_is_int(t) for t in item) for item in prompt):
            return [checked_ids(item, tokenizer, "prompt") for item in prompt]
    if prompt is None:
        raise PromptError("prompt is required", "prompt")
    raise PromptError("prompt must be a string, a list of strings or a list of token ids", "prompt")


def chat_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The ids of a chat request's rendered messages (``add_special_tokens`` defaults to false)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError("every message must be an object with a string role", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise PromptError("tools must be a list", "tools")
    if body.get("chat_template") is not None:
        raise PromptError(
            "Chat template is passed with request, but --trust-request-chat-template is not set.",
            "chat_template",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PromptError("chat_template_kwargs must be an object", "chat_template_kwargs")
    generation = _flag(body, "add_generation_prompt", default=True)
    continue_final = _flag(body, "continue_final_message", default=False)
    if generation and continue_final and "add_generation_prompt" in body:
        raise PromptError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    try:
        text = tokenizer.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=generation and not continue_final,
            chat_template_kwargs=kwargs,
        )
    except ChatTemplateError as exc:
        raise PromptError(str(exc), "messages") from None
    if continue_final:
        text = _continued(text, messages[-1])
    ids = tokenizer.encode_cached(text)
    return tokenizer.with_special_tokens(ids) if _flag(body, "add_special_tokens", default=False) else ids


def checked_ids(ids: list[Any], tokenizer: Tokenizer, param: str) -> list[int]:
    """Client-given token ids, each in the vocabulary."""
    vocab = tokenizer.vocab_size
    for token_id in ids:
        if not _is_int(token_id) or not 0 <= token_id < vocab:
            raise PromptError(f"Token id {token_id} is out of vocabulary", param)
    return ids


def _continued(text: str, final: dict[str, Any]) -> str:
    """The rendered chat cut right after the final message's text (HF ``continue_final_message``)."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and "text" in part]
        content = texts[-1] if texts else None
    if not isinstance(content, str):
        raise PromptError("continue_final_message is set but the final message has no text to continue")
    stripped = content.strip()
    if stripped not in text:
        raise PromptError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template"
        )
    return text[: text.rindex(stripped) + len(stripped)]


def _flag(body: dict[str, Any], name: str, *, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PromptError(f"{name} must be a boolean", name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
