"""Request control: the parser, the saturation detector, and the hooks run around scheduling.

Hooks (request-header processors, screeners, admitters, pre-request, response processors,
request-done) run in ``plugins:`` order.
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
    RequestHeaderProcessor,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
    Screener,
)


@dataclass(slots=True)
class RequestHooks:
    """The plugins of each request-control hook, in ``plugins:`` order."""

    pre_request: list[PreRequest]
    admitters: list[Admitter]
    response_header: list[ResponseHeaderProcessor]
    response_body: list[ResponseBodyProcessor]
    request_done: list[RequestDone]
    request_header: list[RequestHeaderProcessor]
    screeners: list[Screener]


def request_hooks(plugins: Iterable[Plugin]) -> RequestHooks:
    """Hook every plugin into each request-control interface it implements."""
    plugins = list(plugins)
    return RequestHooks(
        pre_request=[p for p in plugins if isinstance(p, PreRequest)],
        admitters=[p for p in plugins if isinstance(p, Admitter)],
        response_header=[p for p in plugins if isinstance(p, ResponseHeaderProcessor)],
        response_body=[p for p in plugins if isinstance(p, ResponseBodyProcessor)],
        request_done=[p for p in plugins if isinstance(p, RequestDone)],
        request_header=[p for p in plugins if isinstance(p, RequestHeaderProcessor)],
        screeners=[p for p in plugins if isinstance(p, Screener)],
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


def resolve_saturation_detector(ctx: LoadContext) -> SaturationDetector | None:
    """The saturation detector, auto-created only when the ref is exactly ``utilization-detector``.

    Without a ``saturationDetector`` section the ref defaults to ``utilization-detector``: an
    instance of that name declared under ``plugins`` is used (with its parameters), otherwise
    one is created with the defaults. It is not added to any profile, so it is not a filter.
    """
    doc = ctx.doc
    ref = doc.saturation_detector
    if ref is None:
        ref = doc.saturation_detector = RefSpec(d.DEFAULT_SATURATION_DETECTOR, "saturationDetector")
        if d.DEFAULT_SATURATION_DETECTOR not in ctx.plugins:
            if registry.lookup(d.DEFAULT_SATURATION_DETECTOR) is None:
                doc.saturation_detector = None
                return None  # not in this build: no saturation detector, no legacy shedding
            ctx.add_default(d.DEFAULT_SATURATION_DETECTOR, "saturation detector")
    where = f"{ref.path}.pluginRef"
    if not ref.plugin_ref:
        raise ConfigError(where, "saturation detector plugin reference is empty")
    plugin = ctx.plugins.get(ref.plugin_ref)
    if plugin is None:
        if ref.plugin_ref == d.DEFAULT_SATURATION_DETECTOR and registry.lookup(ref.plugin_ref) is not None:
            plugin = ctx.add_default(d.DEFAULT_SATURATION_DETECTOR, "saturation detector")
        else:
            raise ConfigError(where, f"saturation detector references undefined plugin '{ref.plugin_ref}'")
    if not isinstance(plugin, SaturationDetector):
        raise ConfigError(
            where, f"plugin '{ref.plugin_ref}' is not a fwkfc.SaturationDetector (type {plugin.type_name})"
        )
    return plugin
