"""``models-responder`` (alpha): the EPP answers ``GET /v1/models`` itself, from the data layer.

A model server knows only its own models, so a routed ``/v1/models`` misses the LoRA adapters
loaded elsewhere. This responder answers with the union of every endpoint's last ``/v1/models``
list (``models-data-extractor``'s attribute; a ``models-data-source`` is added when none is
configured), one entry per id, sorted by id; 503 while no endpoint has reported a list. As a
screener it keeps, for an inference request, the endpoints that list its target model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from epp.framework import (
    Endpoint,
    ErrorCode,
    InferenceError,
    LLMRequest,
    LocalResponse,
    Responder,
    Screener,
    Stability,
    register,
)
from epp.framework.endpoint_attributes import MODELS_KEY, ModelData
from epp.framework.interfaces import Handle

__all__ = ["MODELS_PATH", "ModelsResponder", "models_list"]

MODELS_PATH = "/v1/models"
_JSON = {"content-type": "application/json"}


def _models(endpoint: Endpoint) -> tuple[ModelData, ...] | None:
    models = endpoint.attributes.get(MODELS_KEY)
    return models if isinstance(models, tuple) else None


def models_list(endpoints: Sequence[Endpoint]) -> list[dict[str, Any]] | None:
    """The OpenAI list entries of the pool: per model id the copy of the endpoint with the lowest
    key; None when no endpoint has reported its list yet."""
    seen: dict[str, dict[str, Any]] = {}
    reported = False
    for endpoint in sorted(endpoints, key=lambda e: e.metadata.key):
        models = _models(endpoint)
        if models is None:
            continue
        reported = True
        for m in models:
            if m.id and m.id not in seen:
                entry: dict[str, Any] = {"id": m.id}
                if m.object:
                    entry["object"] = m.object
                if m.created:
                    entry["created"] = m.created
                if m.owned_by:
                    entry["owned_by"] = m.owned_by
                seen[m.id] = entry
    if not reported:
        return None
    return [seen[k] for k in sorted(seen)]


@register
class ModelsResponder(Responder, Screener):
    type_name = "models-responder"
    stability = Stability.ALPHA
    consumes = frozenset({MODELS_KEY})

    def __init__(self, name: str, params: Any = None, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)

    def respond(self, method: str, path: str, endpoints: Sequence[Endpoint]) -> LocalResponse | None:
        if method != "GET" or (path[:-1] if path.endswith("/") else path) != MODELS_PATH:
            return None
        data = models_list(endpoints)
        if data is None:
            raise InferenceError(
                ErrorCode.SERVICE_UNAVAILABLE, "no model data collected yet from any endpoint"
            )
        return LocalResponse(200, orjson.dumps({"object": "list", "data": data}), _JSON)

    def screen(self, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        """Endpoints listing the target model (and, for a base model, those not reported yet);
        with none listing it, the unreported ones, else all (the lists may be incomplete)."""
        target = request.target_model
        if not target:
            return endpoints
        serving: list[Endpoint] = []
        unlisted: list[Endpoint] = []
        adapter = False
        for e in endpoints:
            models = _models(e)
            if models is None:
                unlisted.append(e)
                continue
            for m in models:
                if m.id == target:
                    serving.append(e)
                    adapter = adapter or bool(m.parent)
                    break
        if serving:
            return serving if adapter else serving + unlisted
        return unlisted or endpoints
