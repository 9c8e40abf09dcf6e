"""Chat templates as HF transformers renders them: Jinja2 in an immutable sandbox with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a no-op ``{% generation %}``
block, ``raise_exception``, ``strftime_now`` and a ``tojson`` filter that keeps non-ASCII text.

Before rendering, request messages are prepared as vLLM prepares them: a content list becomes its
text parts joined by newlines (or stays a list of text parts when the template iterates over
``content``), missing content becomes ``""``, and tool-call arguments given as JSON strings become
objects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that failed (or raised) while rendering."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template; ``render`` is safe to call from several threads."""

    __slots__ = ("_template", "content_as_list", "source")

    def __init__(self, source: str) -> None:
        env = _environment()
        try:
            self._template = env.from_string(source)
            parsed = env.parse(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.content_as_list = _iterates_content(parsed)
        """vLLM's "openai" content format: the template loops over a message's content parts."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages`` (prepared as vLLM does); ``variables`` are the special
        tokens and the request's ``chat_template_kwargs``."""
        prepared = [prepare_message(m, content_as_list=self.content_as_list) for m in messages]
        context = dict(variables or {})
        context.update(messages=prepared, tools=list(tools) if tools else None)
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def prepare_message(message: Mapping[str, Any], *, content_as_list: bool = False) -> dict[str, Any]:
    """A request message as the template sees it (content flattened, tool-call arguments parsed)."""
    prepared = dict(message)
    prepared["content"] = _content(message.get("content"), as_list=content_as_list)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        prepared["tool_calls"] = [_parsed_arguments(call) for call in calls]
    return prepared


def _content(content: Any, *, as_list: bool) -> Any:
    if content is None:
        return [] if as_list else ""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if as_list else content
    if not isinstance(content, list):
        return content
    texts = [
        part if isinstance(part, str) else part.get("text", "")
        for part in content
        if isinstance(part, str) or (isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES)
    ]
    if as_list:
        return [{"type": "text", "text": text} for text in texts]
    return "\n".join(str(text) for text in texts)


def _parsed_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**call["function"], "arguments": parsed}}


def _iterates_content(template: jinja2.nodes.Template) -> bool:
    """Whether a ``for`` loop iterates over ``<message>['content']`` / ``.content`` / ``content``."""
    for loop in template.find_all(jinja2.nodes.For):
        target = loop.iter
        if isinstance(target, jinja2.nodes.Filter) and target.node is not None:
            target = target.node
        if _names_content(target):
            return True
    return False


def _names_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name == "content"
