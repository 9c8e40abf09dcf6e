"""The simulator's aiohttp application: its routes, ``/health`` and the ``/debug/requests`` journal."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from epp.dev.sim import generate, inference, kv_admin, stats, tokenize
from epp.dev.sim.context import (
    CONFIG_KEY,
    CREATED_KEY,
    ENGINE_KEY,
    JOURNAL_KEY,
    POD_KEY,
    PUBLISHER_KEY,
    REGISTRY_KEY,
    RNG_KEY,
    PublisherSlot,
    RequestJournal,
    add_identity_headers,
)
from epp.dev.sim.engine import Engine, SimConfig
from epp.dev.sim.metrics import EngineCollector, metrics
from epp.dev.sim.openai import OpenAIError, error_middleware, json_response

MAX_BODY_BYTES = 64 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(config: SimConfig) -> web.Application:
    """A fresh simulator app with its own engine, journal and metrics registry.

    Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (optionally SSE), ``GET /v1/models``,
    vLLM's ``POST /tokenize``, ``/detokenize``, ``/v1/completions/render`` and
    ``/v1/chat/completions/render``, the token-in ``POST /inference/v1/generate`` (vLLM) and
    ``/generate`` (SGLang), ``/health``, ``/metrics`` (vLLM names), ``POST /reset_prefix_cache``,
    ``GET``/``DELETE /debug/requests`` (the last requests received) and the simulator-only
    ``GET /sim/kv-events``, ``POST /sim/kv-events/drop`` / ``corrupt?count=N``, ``GET /sim/stats``
    (current and peak queue and batch) and ``POST /sim/stats/reset``. Any other ``POST``
    is journaled and answered 404. Every response carries ``x-inference-pod``, ``-namespace`` and
    ``-port``; errors use the OpenAI shape
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
    app[PUBLISHER_KEY] = PublisherSlot()
    app.on_response_prepare.append(add_identity_headers)
    app.router.add_post("/v1/completions", inference.completions)
    app.router.add_post("/v1/chat/completions", inference.chat_completions)
    app.router.add_get("/v1/models", inference.models)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    scale_out = config.enable_scale_out
    app.router.add_post("/v1/completions/render", tokenize.render_completions if scale_out else _no_scale_out)
    app.router.add_post("/v1/chat/completions/render", tokenize.render_chat if scale_out else _no_scale_out)
    app.router.add_post("/inference/v1/generate", generate.vllm_generate if scale_out else _no_scale_out)
    app.router.add_post("/generate", generate.sglang_generate)
    app.router.add_get("/health", health)
    if not config.metrics_port:
        app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/requests", debug_requests)
    app.router.add_delete("/debug/requests", clear_debug_requests)
    app.router.add_post("/reset_prefix_cache", kv_admin.reset_prefix_cache)
    app.router.add_get("/sim/kv-events", kv_admin.kv_events_state)
    app.router.add_post("/sim/kv-events/drop", kv_admin.drop_kv_events)
    app.router.add_post("/sim/kv-events/corrupt", kv_admin.corrupt_kv_events)
    app.router.add_get("/sim/stats", stats.stats)
    app.router.add_post("/sim/stats/reset", stats.reset_stats)
    app.router.add_post("/{path:.*}", unserved)
    return app


async def unserved(request: web.Request) -> web.Response:
    """A POST to a path the simulator does not serve: journaled (routing is visible), then 404."""
    request.app[JOURNAL_KEY].record(request, await request.read())
    return OpenAIError(404, f"{request.path} is not served", "NotFoundError").response()


def build_side_app(main: web.Application, handler: Handler, pod: str) -> web.Application:
    """An app serving only ``GET /metrics`` with ``handler``, sharing ``main``'s engine and registry."""
    app = web.Application()
    app[CONFIG_KEY] = main[CONFIG_KEY]
    app[ENGINE_KEY] = main[ENGINE_KEY]
    app[REGISTRY_KEY] = main[REGISTRY_KEY]
    app[POD_KEY] = pod
    app.router.add_get("/metrics", handler)
    return app


async def health(_: web.Request) -> web.Response:
    return web.Response(status=200)


async def debug_requests(request: web.Request) -> web.Response:
    return json_response(list(request.app[JOURNAL_KEY].entries))


async def clear_debug_requests(request: web.Request) -> web.Response:
    return json_response({"cleared": request.app[JOURNAL_KEY].clear()})


SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)


async def _no_scale_out(request: web.Request) -> web.Response:
    """vLLM 0.32 without ``--enable-scale-out``: the render and token-in endpoints answer 403."""
    error = {"message": SCALE_OUT_DISABLED, "type": "PermissionDeniedError", "param": None, "code": 403}
    return web.json_response({"error": error}, status=403)
