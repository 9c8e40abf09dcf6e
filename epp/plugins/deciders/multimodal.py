"""``always-disagg-multimodal-decider``: run the encode stage for chat requests carrying media."""

from __future__ import annotations

from typing import Any

from epp.framework import ApiKind, CycleState, Endpoint, LLMRequest, register
from epp.framework.interfaces import Decider

MULTIMODAL_BLOCK_TYPES = frozenset({"image_url", "video_url", "input_audio"})


def has_multimodal_content(request: LLMRequest) -> bool:
    """Whether a chat-completions request contains an image, video or audio content block."""
    if request.body.api is not ApiKind.CHAT_COMPLETIONS:
        return False
    messages = request.body.payload.get("messages")
    if not isinstance(messages, list):
        return False
    return any(_message_has_media(m) for m in messages)


def _message_has_media(message: Any) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if not isinstance(content, list):
        return False
    return any(isinstance(b, dict) and b.get("type") in MULTIMODAL_BLOCK_TYPES for b in content)


@register
class AlwaysDisaggMultimodalDecider(Decider):
    type_name = "always-disagg-multimodal-decider"

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
        return has_multimodal_content(request)
