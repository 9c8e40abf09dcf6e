"""Request control: the hooks run around scheduling.

Hooks (request-header processors, screeners, admitters, pre-request, response processors,
request-done) run in ``plugins:`` order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from epp.config import defaults as d
from epp.config.context import LoadContext
from epp.framework import registry
from epp.framework.interfaces import (
    Admitter,
    Plugin,
    PreRequest,
    RequestDone,
    RequestHeaderProcessor,
    Responder,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
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
    responders: list[Responder]


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
        responders=[p for p in plugins if isinstance(p, Responder)],
    )


def apply_health_default(ctx: LoadContext) -> None:
    """Add ``endpoint-health-filter`` with its defaults unless one is declared: a configuration
    written without it (every reference one) still keeps dead engines out of scheduling."""
    if registry.lookup(d.ENDPOINT_HEALTH_FILTER) is None:
        return
    if any(p.type_name == d.ENDPOINT_HEALTH_FILTER for p in ctx.plugins.values()):
        return
    ctx.add_default(d.ENDPOINT_HEALTH_FILTER, "endpoint health")
