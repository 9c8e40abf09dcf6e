"""vLLM's context-length checks on a prompt's token count, for the simulated engine."""

from __future__ import annotations

from epp.tokenization.requests import PromptError


def check_length(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's context-length checks: a non-empty prompt shorter than the model length, and room for
    the requested output."""
    if prompt_tokens == 0:
        raise PromptError("The decoder prompt cannot be empty")
    if prompt_tokens >= max_model_len:
        raise PromptError(
            f"The decoder prompt (length {prompt_tokens}) is longer than the maximum model length of "
            f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens."
        )
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise PromptError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens}).",
            "max_tokens",
        )
