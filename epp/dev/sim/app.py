"""The simulator's aiohttp application: its routes, ``/health`` and the ``/debug/requests`` journal."""

from __future__ import annotations

import random
import time

from aiohttp import web
from prometheus_client import CollectorRegistry

from epp.dev.sim import inference
from epp.dev.sim.context import (
    CONFIG_KEY,
    CREATED_KEY,
    ENGINE_KEY,
    JOURNAL_KEY,
    REGISTRY_KEY,
    RNG_KEY,
    RequestJournal,
    add_identity_headers,
)
from epp.dev.sim.engine import Engine, SimConfig
from epp.dev.sim.metrics import EngineCollector, metrics
from epp.dev.sim.openai import OpenAIError, error_middleware, json_response

MAX_BODY_BYTES = 64 * 1024 * 1024


def build_app(config: SimConfig) -> web.Application:
    """A fresh simulator app with its own engine, journal and metrics registry.

    Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (optionally SSE), ``GET /v1/models``,
    ``/health``, ``/metrics`` (vLLM names) and ``GET``/``DELETE /debug/requests`` (the last requests
    received). Any other ``POST`` is journaled and answered 404. Every response carries
    ``x-inference-pod``, ``-namespace`` and ``-port``; errors use the OpenAI shape
    ``{"error": {"message", "type", "param", "code"}}``.
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    engine = Engine(config)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    app[CONFIG_KEY] = config
    app[ENGINE_KEY] = engine
    app[JOURNAL_KEY] = RequestJournal()
    app[REGISTRY_KEY] = registry
    app[CREATED_KEY] = int(time.time())
    app[RNG_KEY] = random.Random(config.seed)
    app.on_response_prepare.append(add_identity_headers)
    app.router.add_post("/v1/completions", inference.completions)
    app.router.add_post("/v1/chat/completions", inference.chat_completions)
    app.router.add_get("/v1/models", inference.models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/requests", debug_requests)
    app.router.add_delete("/debug/requests", clear_debug_requests)
    app.router.add_post("/{path:.*}", unserved)
    return app


async def unserved(request: web.Request) -> web.Response:
    """A POST to a path the simulator does not serve: journaled (routing is visible), then 404."""
    request.app[JOURNAL_KEY].record(request, await request.read())
    return OpenAIError(404, f"{request.path} is not served", "NotFoundError").response()


async def health(_: web.Request) -> web.Response:
    return web.Response(status=200)


async def debug_requests(request: web.Request) -> web.Response:
    return json_response(list(request.app[JOURNAL_KEY].entries))


async def clear_debug_requests(request: web.Request) -> web.Response:
    return json_response({"cleared": request.app[JOURNAL_KEY].clear()})
