"""The request handler phase: ``requestHandler.parsers`` -> the table that picks a parser per request.

Without parsers (and without the deprecated top-level ``parser``) the default list is
``openai-parser``, ``anthropic-parser``, ``vllmhttp-parser`` and ``passthrough-parser`` (the
fallback for unclaimed paths). An explicit list is used as given: no fallback is added. A reference
to an undeclared plugin named like a registered type creates that plugin with its defaults.
"""

from __future__ import annotations

from epp.config.context import LoadContext
from epp.config.schema import RefSpec, RequestHandlerSpec
from epp.framework import registry
from epp.framework.errors import ConfigError
from epp.framework.interfaces import Parser
from epp.scheduling.parser_router import ParserRouter

DEFAULT_PARSERS = ("openai-parser", "anthropic-parser", "vllmhttp-parser", "passthrough-parser")
_FIELD = "requestHandler.parsers"


def _refs(ctx: LoadContext) -> list[RefSpec]:
    """The parser references in effect; the document is updated to show them under ``requestHandler``."""
    doc = ctx.doc
    refs = doc.request_handler.parsers if doc.request_handler is not None else []
    legacy = doc.parser
    if legacy is not None:
        if refs:
            ctx.warnings.append(
                "top-level parser is deprecated and ignored: requestHandler.parsers is set and used"
            )
        else:
            ctx.warnings.append("top-level parser is deprecated: use requestHandler.parsers instead")
            refs = [legacy]
        doc.parser = None
    if not refs:
        refs = [RefSpec(t, f"{_FIELD}[{i}]") for i, t in enumerate(DEFAULT_PARSERS)]
    if doc.request_handler is None:
        doc.request_handler = RequestHandlerSpec()
    doc.request_handler.parsers = refs
    return refs


def _parser(ctx: LoadContext, ref: RefSpec) -> Parser:
    where = f"{ref.path}.pluginRef"
    name = ref.plugin_ref
    if not name:
        raise ConfigError(where, "parser plugin reference is empty")
    plugin = ctx.get(name)
    if plugin is None:
        if registry.lookup(name) is None:
            raise ConfigError(
                where,
                f"the configured parser is not loaded: no plugin named '{name}' is declared under "
                "plugins, and no plugin type has that name",
            )
        plugin = ctx.add_default(name, "parser")
    if not isinstance(plugin, Parser):
        raise ConfigError(
            where, f"the plugin '{name}' is not a parser plugin (it has type {plugin.type_name})"
        )
    return plugin


def resolve_parsers(ctx: LoadContext) -> ParserRouter:
    """The configured parsers, checked, as the per-request parser table."""
    parsers = [_parser(ctx, ref) for ref in _refs(ctx)]
    return ParserRouter.build(parsers, ctx.warnings.append)
