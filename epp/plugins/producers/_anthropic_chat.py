"""An Anthropic Messages request in the OpenAI chat shape vLLM builds when it serves ``/v1/messages``.

``token-producer``'s render backends tokenize that shape, so that the ids match what the engine
computes: a top-level ``system`` message, ``tool_use`` blocks as ``tool_calls`` (arguments as
Python's ``json.dumps``), user ``tool_result`` blocks as ``tool`` messages placed before the user
message that carried them, images as ``image_url`` parts, thinking as ``reasoning``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from epp.plugins.producers._token_estimate import (
    anthropic_image_url,
    anthropic_system_text,
    tool_result_content,
)


def messages_to_chat(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``{"messages": [...], "tools": [...]}`` (tools only when given) of a Messages payload."""
    out: list[dict[str, Any]] = []
    system = anthropic_system_text(payload.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    messages = payload.get("messages")
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        role = _text(m.get("role"))
        if role == "system":
            text = anthropic_system_text(m.get("content"))
            if text:
                out.append({"role": "system", "content": text})
            continue
        _append_message(out, role, m.get("content"))
    chat: dict[str, Any] = {"messages": out}
    tools = _tools(payload.get("tools"))
    if tools:
        chat["tools"] = tools
    return chat


def _append_message(out: list[dict[str, Any]], role: str, content: Any) -> None:
    if isinstance(content, str) and content:
        out.append({"role": role, "content": content})
        return
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning = ""
    for b in content if isinstance(content, list) else ():
        if not isinstance(b, dict):
            continue
        kind = b.get("type")
        if kind == "text":
            if b.get("text"):
                parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            url = anthropic_image_url(b.get("source"))
            if url:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "thinking":
            reasoning += _text(b.get("thinking"))
        elif kind == "tool_use":
            tool_calls.append(_tool_call(b))
        elif kind == "tool_result":
            text, images = tool_result_content(b)
            if role == "user":
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""), "content": text})
                if images:
                    out.append(
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": u}} for u in images],
                        }
                    )
            else:
                parts.append({"type": "text", "text": "Tool result: " + text})
    msg: dict[str, Any] = {"role": role}
    if len(parts) == 1 and parts[0]["type"] == "text":
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts
    if reasoning:
        msg["reasoning"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    if role == "user" and "content" not in msg:
        return  # a user message of bare tool results: its tool messages are already in
    out.append(msg)


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _tool_call(b: dict[str, Any]) -> dict[str, Any]:
    args = b.get("input")
    return {
        "id": b.get("id") or "call_0000000000",
        "type": "function",
        "function": {"name": b.get("name", ""), "arguments": json.dumps(args) if args else "{}"},
    }


def _tools(tools: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in tools if isinstance(tools, list) else ():
        if not isinstance(t, dict):
            continue
        schema = t.get("input_schema")
        fn: dict[str, Any] = {
            "name": t.get("name", ""),
            "parameters": schema if schema is not None else {"type": "object"},
        }
        for src, dst in (
            ("description", "description"),
            ("strict", "strict"),
            ("defer_loading", "defer_loading"),
        ):
            if t.get(src) not in (None, ""):
                fn[dst] = t[src]
        out.append({"type": "function", "function": fn})
    return out
