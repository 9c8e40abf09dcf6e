"""Builders for the objects unit tests schedule with: endpoints, metrics, requests, handles, directors,
and configurations from a YAML body (``config`` / ``config_error``).

Every argument has a default, so a test names only what it is about. Metrics built by
``known_metrics`` are fresh (known to the metric scorers) until ``fresh_until``, forever by default;
an endpoint built without metrics has ``Metrics()``, which counts as never scraped.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, Unpack

import pytest

from epp.config import ConfigError, LoadedConfig, load_config
from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.rewrites import RewriteStore
from epp.datalayer.store import EndpointStore
from epp.framework import (
    ApiKind,
    Endpoint,
    EndpointMetadata,
    Filter,
    LLMRequest,
    Metrics,
    Plugin,
    PreRequest,
    RequestBody,
    SaturationDetector,
)
from epp.plugins.parsers.openai import OpenAIParser
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.profile_handlers.single import SingleProfileHandler
from epp.plugins.scorers.queue import QueueScorer
from epp.scheduling import Scheduler, SchedulerProfile, WeightedScorer
from epp.server.director import Director, DirectorHooks

FRESH = math.inf  # ``fresh_until`` of metrics that never go stale


class MetricFields(TypedDict, total=False):
    """The scraped values of ``Metrics`` (all but ``fresh_until``), as keyword arguments."""

    waiting_queue_size: int
    running_requests_size: int
    kv_cache_usage_percent: float
    active_models: Mapping[str, int]
    waiting_models: Mapping[str, int]
    max_active_models: int
    cache_block_size: int
    cache_num_blocks: int
    served_models: tuple[str, ...]
    update_time: float
    failure: str
    inflight_at_scrape: int
    peak_running: int
    loaded_adapters: Mapping[str, str]
    gpu_loaded_adapters: int
    lora_residency: bool


class MetadataFields(TypedDict, total=False):
    """The optional members of ``EndpointMetadata`` that ``metadata`` takes, as keyword arguments."""

    namespace: str
    labels: Mapping[str, str] | None
    metrics_host: str


# --- endpoints ---------------------------------------------------------------------------------


def known_metrics(
    base: Metrics | None = None, /, *, fresh_until: float = FRESH, **fields: Unpack[MetricFields]
) -> Metrics:
    """``base`` (default ``Metrics()``) with ``fields`` set, trusted by the scheduler until
    ``fresh_until`` (``time.monotonic()``; default: always)."""
    return dataclasses.replace(base or Metrics(), fresh_until=fresh_until, **fields)


def metadata(
    name: str = "e0",
    address: str = "10.0.0.1",
    port: int = 8000,
    *,
    namespace: str = "default",
    labels: Mapping[str, str] | None = None,
    metrics_host: str = "",
) -> EndpointMetadata:
    return EndpointMetadata(
        name, address, port, namespace=namespace, labels=dict(labels or {}), metrics_host=metrics_host
    )


def endpoint(
    name: str = "e0",
    address: str = "10.0.0.1",
    port: int = 8000,
    *,
    metrics: Metrics | None = None,
    **fields: Unpack[MetadataFields],
) -> Endpoint:
    """An endpoint; without ``metrics`` it was never scraped (``Metrics()``)."""
    return Endpoint(metadata(name, address, port, **fields), metrics if metrics is not None else Metrics())


def endpoints(
    n: int, *, prefix: str = "e", port: int = 8000, metrics: Metrics | None = None
) -> list[Endpoint]:
    """``n`` endpoints ``{prefix}{i}`` at ``10.0.0.{i}``, ``i`` counting from 0, sharing ``metrics``."""
    return [endpoint(f"{prefix}{i}", f"10.0.0.{i}", port, metrics=metrics) for i in range(n)]


# --- requests ----------------------------------------------------------------------------------


def request(
    payload: dict[str, Any] | None = None,
    *,
    api: ApiKind = ApiKind.COMPLETIONS,
    model: str = "m",
    headers: Mapping[str, str] | None = None,
    request_id: str = "r1",
    size: int = 0,
) -> LLMRequest:
    """A parsed request for ``model`` (incoming and target); ``payload`` defaults to a completion."""
    body = RequestBody(api, payload if payload is not None else {"model": model, "prompt": "p"}, b"")
    return LLMRequest(request_id, body, dict(headers or {}), model, model, request_size_bytes=size)


def completions(
    prompt: Any = "p",
    *,
    model: str = "m",
    headers: Mapping[str, str] | None = None,
    request_id: str = "r1",
    size: int = 0,
    **fields: Any,
) -> LLMRequest:
    """A ``/v1/completions`` request; ``fields`` are further payload members (e.g. ``cache_salt``)."""
    payload = {"model": model, "prompt": prompt, **fields}
    return request(payload, model=model, headers=headers, request_id=request_id, size=size)


def chat(
    messages: list[Any],
    *,
    model: str = "m",
    headers: Mapping[str, str] | None = None,
    request_id: str = "r1",
) -> LLMRequest:
    """A ``/v1/chat/completions`` request."""
    payload = {"model": model, "messages": messages}
    return request(payload, api=ApiKind.CHAT_COMPLETIONS, model=model, headers=headers, request_id=request_id)


# --- plugin handles and directors --------------------------------------------------------------


class StubHandle:
    """A plugin factory's ``Handle``: the given plugins by name and a fixed endpoint list."""

    def __init__(self, *plugins: Plugin, endpoints: Sequence[Endpoint] = ()) -> None:
        self.plugins = {p.name: p for p in plugins}
        self.eps = list(endpoints)

    def plugin(self, name: str) -> Plugin | None:
        return self.plugins.get(name)

    def endpoints(self) -> Sequence[Endpoint]:
        return self.eps


def director(
    store: EndpointStore,
    *,
    filters: Sequence[Filter] = (),
    pre_request: Sequence[PreRequest] = (),
    saturation_detector: SaturationDetector | None = None,
    objectives: ObjectiveStore | None = None,
    rewrites: RewriteStore | None = None,
    rng: random.Random | None = None,
) -> Director:
    """A director over ``store``: OpenAI parser, one profile (``filters``, queue scorer, max-score)."""
    profile = SchedulerProfile(
        name="default",
        filters=list(filters),
        scorers=[WeightedScorer(QueueScorer("queue-scorer", None), 1.0)],
        picker=MaxScorePicker("max-score-picker", PickerParams()),
    )
    scheduler = Scheduler(SingleProfileHandler("single-profile-handler", None), {"default": profile})
    return Director(
        store,
        OpenAIParser("openai-parser", None),
        scheduler,
        DirectorHooks(pre_request=list(pre_request)),
        saturation_detector=saturation_detector,
        objectives=objectives,
        rewrites=rewrites,
        rng=rng,
    )


CONFIG_HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
NO_ENV: dict[str, str] = {}


def config(body: str, **kw: Any) -> LoadedConfig:
    """``load_config`` of an ``EndpointPickerConfig`` with ``body`` after its header (no environment)."""
    kw.setdefault("environ", NO_ENV)
    return load_config(CONFIG_HEADER + body, **kw)


def config_error(body: str, **kw: Any) -> ConfigError:
    """The ``ConfigError`` that loading ``body`` raises (fails the test if it loads)."""
    with pytest.raises(ConfigError) as info:
        config(body, **kw)
    return info.value
