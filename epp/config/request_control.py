"""Request control: the parser and the hooks run around scheduling.

Hooks (pre-request, admitters, response processors, request-done) run in ``plugins:`` order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from epp.config import defaults as d
from epp.config.context import LoadContext
from epp.config.schema import RefSpec
from epp.framework import registry
from epp.framework.errors import ConfigError
from epp.framework.interfaces import (
    Admitter,
    Parser,
    Plugin,
    PreRequest,
    RequestDone,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
)


@dataclass(slots=True)
class RequestHooks:
    """The plugins of each request-control hook, in ``plugins:`` order."""

    pre_request: list[PreRequest]
    admitters: list[Admitter]
    response_header: list[ResponseHeaderProcessor]
    response_body: list[ResponseBodyProcessor]
    request_done: list[RequestDone]


def request_hooks(plugins: Iterable[Plugin]) -> RequestHooks:
    """Hook every plugin into each request-control interface it implements."""
    plugins = list(plugins)
    return RequestHooks(
        pre_request=[p for p in plugins if isinstance(p, PreRequest)],
        admitters=[p for p in plugins if isinstance(p, Admitter)],
        response_header=[p for p in plugins if isinstance(p, ResponseHeaderProcessor)],
        response_body=[p for p in plugins if isinstance(p, ResponseBodyProcessor)],
        request_done=[p for p in plugins if isinstance(p, RequestDone)],
    )


def resolve_parser(ctx: LoadContext) -> Parser:
    """The ``parser`` plugin; the default ``openai-parser`` is created when none is named."""
    doc = ctx.doc
    ref = doc.parser
    if ref is None or not ref.plugin_ref:
        ref = doc.parser = RefSpec(d.DEFAULT_PARSER, "parser")
    where = f"{ref.path}.pluginRef"
    plugin = ctx.plugins.get(ref.plugin_ref)
    if plugin is None:
        if ref.plugin_ref != d.DEFAULT_PARSER:
            raise ConfigError(
                where, f"the configured parser is not loaded: no plugin named '{ref.plugin_ref}'"
            )
        if registry.lookup(d.DEFAULT_PARSER) is None:
            raise ConfigError(
                where,
                f"the configured parser is not loaded: plugin type '{d.DEFAULT_PARSER}' is not registered",
            )
        plugin = ctx.add_default(d.DEFAULT_PARSER, "parser")
    if not isinstance(plugin, Parser):
        raise ConfigError(
            where,
            f"the specified plugin is not a parser plugin in the config "
            f"('{plugin.name}' has type {plugin.type_name})",
        )
    return plugin
