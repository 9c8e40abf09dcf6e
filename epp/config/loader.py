"""Loading an ``EndpointPickerConfig``: the entry points, the order of the phases, ``LoadedConfig``.

Each phase lives in its own module: feature gates, plugin instantiation (``context``), profiles,
request control, flow control, data layer and data producers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import epp.plugins  # noqa: F401 - the composition root registers the built-in plugin types
from epp.config import defaults as d
from epp.config.context import EndpointsFn, LoadContext
from epp.config.data_layer import (
    CrossReplicaSettings,
    add_models_source,
    apply_data_layer_defaults,
    build_data_layer,
    check_cross_replica,
    resolve_discovery,
    warn_unused_data_sources,
)
from epp.config.effective import render_effective
from epp.config.feature_gates import resolve_feature_gates
from epp.config.flow_control import (
    apply_flow_control_defaults,
    check_flow_control,
    ignore_flow_control,
    move_deprecated_saturation_detector,
    resolve_saturation_detector,
)
from epp.config.producers import create_missing_producers, ordered_producers
from epp.config.profiles import (
    apply_scheduling_defaults,
    build_scheduler,
    validate_profiles,
    warn_multi_endpoint_pickers,
    warn_unused_scheduling_plugins,
    with_default_scheduling,
)
from epp.config.removed import COMPAT_VERSIONS, apply_removed_roles, check_removed
from epp.config.request_control import apply_health_default, request_hooks
from epp.config.request_handler import resolve_parsers
from epp.config.schema import (
    API_VERSION,
    GATE_FLOW_CONTROL,
    GATE_LEGACY_METRICS,
    ConfigDocument,
    decode_document,
    parse_yaml,
)
from epp.framework.errors import ConfigError
from epp.framework.interfaces import (
    Admitter,
    DataProducer,
    DataSource,
    EndpointDiscovery,
    Extractor,
    Plugin,
    PreRequest,
    RequestDone,
    RequestHeaderProcessor,
    Responder,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
    Screener,
)
from epp.scheduling import Scheduler
from epp.scheduling.parser_router import ParserRouter

__all__ = ["EndpointsFn", "LoadedConfig", "load_config", "load_config_file", "load_document"]


@dataclass(slots=True)
class LoadedConfig:
    """Everything the runner needs from a configuration, plus its effective document."""

    document: ConfigDocument
    scheduler: Scheduler
    plugins: dict[str, Plugin]
    parsers: ParserRouter
    discovery: EndpointDiscovery | None
    data_sources: list[tuple[DataSource, list[Extractor]]]
    feature_gates: frozenset[str]
    saturation_detector: SaturationDetector | None = None
    pre_request: list[PreRequest] = field(default_factory=list)
    producers: list[DataProducer] = field(default_factory=list)
    admitters: list[Admitter] = field(default_factory=list)
    response_header: list[ResponseHeaderProcessor] = field(default_factory=list)
    response_body: list[ResponseBodyProcessor] = field(default_factory=list)
    request_done: list[RequestDone] = field(default_factory=list)
    request_header: list[RequestHeaderProcessor] = field(default_factory=list)
    screeners: list[Screener] = field(default_factory=list)
    responders: list[Responder] = field(default_factory=list)
    propagate_priority: bool = False  # requestHandler.propagatePriority
    warnings: list[str] = field(default_factory=list)
    source: str = "<config>"
    cross_replica: CrossReplicaSettings | None = None  # replicas share routing state (a syncer)

    @property
    def needs_response_body(self) -> bool:
        """Whether any ResponseBodyProcessor is configured (the EPP must then stream response bodies)."""
        return bool(self.response_body)

    @property
    def flow_control_enabled(self) -> bool:
        return GATE_FLOW_CONTROL in self.feature_gates

    def effective_yaml(self, api_version: str = API_VERSION) -> str:
        """The effective configuration as YAML: defaults filled in, effective plugin parameters, in
        the layout of ``api_version`` (v1 unless ``llm-d.ai/v1alpha1`` is asked for)."""
        return render_effective(self.document, self.plugins, api_version)


def load_config(
    text: str | None,
    source: str = "<config>",
    *,
    endpoints: EndpointsFn | None = None,
    environ: Mapping[str, str] | None = None,
    allow_experimental: bool = True,
    compat_version: str = "",
    feature_gates: Mapping[str, bool] | None = None,
) -> LoadedConfig:
    """Load a configuration from YAML/JSON text; ``None``, empty or comment-only → the default one.

    ``endpoints`` is what plugin factories see as ``handle.endpoints()`` (default: none).
    ``environ`` defaults to ``os.environ`` (read for ``ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER``).
    ``allow_experimental=False`` refuses alpha plugin types (the command line's default, unless
    ``--allow-experimental-plugins``). ``compat_version="v0.11"`` refuses what router v0.11 removed.
    ``feature_gates`` (``--feature-gates``) override the document's ``featureGates``.
    """
    raw: Any = None
    if text is not None and text.strip():
        raw = parse_yaml(text, source)
    if raw is None:
        raw = d.default_document()
    return load_document(
        raw,
        source,
        endpoints=endpoints,
        environ=environ,
        allow_experimental=allow_experimental,
        compat_version=compat_version,
        feature_gates=feature_gates,
    )


def load_config_file(
    path: str,
    *,
    endpoints: EndpointsFn | None = None,
    environ: Mapping[str, str] | None = None,
    allow_experimental: bool = True,
    compat_version: str = "",
    feature_gates: Mapping[str, bool] | None = None,
) -> LoadedConfig:
    """Load a configuration file (``--config-file``); error messages name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            "", f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    return load_config(
        text,
        path,
        endpoints=endpoints,
        environ=environ,
        allow_experimental=allow_experimental,
        compat_version=compat_version,
        feature_gates=feature_gates,
    )


def load_document(
    raw: Any,
    source: str = "<config>",
    *,
    endpoints: EndpointsFn | None = None,
    environ: Mapping[str, str] | None = None,
    allow_experimental: bool = True,
    compat_version: str = "",
    feature_gates: Mapping[str, bool] | None = None,
) -> LoadedConfig:
    """Load an already parsed document (a dict as produced by YAML)."""
    if compat_version not in COMPAT_VERSIONS:
        raise ValueError(f"unknown compat version {compat_version!r}")
    errors: list[ConfigError] = []
    doc = decode_document(with_default_scheduling(raw), errors)
    env = os.environ if environ is None else environ
    ctx = LoadContext(doc, source, endpoints, env, allow_experimental=allow_experimental)
    for error in errors:
        ctx.report(error)
    return _load(ctx, compat_version, feature_gates or {})


def _load(ctx: LoadContext, compat_version: str, gate_overrides: Mapping[str, bool]) -> LoadedConfig:
    """Check and instantiate ``plugins`` (dependencies first, whatever the list order), validate
    the profiles, apply the system defaults (skipping types not registered in this build, except
    the parser), create missing producers, then build the scheduler, data layer, discovery and
    flow control. Request-control hooks keep ``plugins:`` order.

    Every phase runs even after an error, so that one run reports every independent error
    (``ctx.attempt``); the errors are raised at the end, the first one as a single error said.
    """
    doc = ctx.doc
    if doc.api_version != API_VERSION:
        ctx.warnings.append(
            f"apiVersion '{doc.api_version}' is deprecated; use '{API_VERSION}' "
            "(`epp check-config` prints this configuration converted to it)"
        )
        doc.api_version = API_VERSION
    ctx.attempt(move_deprecated_saturation_detector, ctx)
    ctx.attempt(check_removed, ctx, compat_version)
    gates = ctx.attempt(resolve_feature_gates, ctx, gate_overrides) or frozenset()
    legacy_metrics = GATE_LEGACY_METRICS in gates
    if legacy_metrics:
        ctx.instantiate_all(d.CORE_METRICS_EXTRACTOR, f"with feature gate '{GATE_LEGACY_METRICS}'")
    else:
        ctx.instantiate_all()
    validate_profiles(ctx)
    ctx.attempt(apply_scheduling_defaults, ctx)
    ctx.attempt(apply_flow_control_defaults, ctx)
    ctx.attempt(apply_health_default, ctx)
    parsers = ctx.attempt(resolve_parsers, ctx)
    saturation_detector = ctx.attempt(resolve_saturation_detector, ctx)
    if not legacy_metrics:
        ctx.attempt(apply_data_layer_defaults, ctx)
        ctx.attempt(add_models_source, ctx)
    ctx.attempt(create_missing_producers, ctx)
    ctx.attempt(apply_removed_roles, ctx, compat_version)
    scheduler = ctx.attempt(build_scheduler, ctx)
    data_sources = [] if legacy_metrics else ctx.attempt(build_data_layer, ctx)
    discovery = ctx.attempt(resolve_discovery, ctx)
    cross_replica = ctx.attempt(check_cross_replica, ctx)
    if GATE_FLOW_CONTROL in gates:
        ctx.attempt(check_flow_control, ctx)
    else:
        ctx.attempt(ignore_flow_control, ctx)
    if scheduler is not None:
        ctx.attempt(warn_multi_endpoint_pickers, ctx, scheduler)
    ctx.attempt(warn_unused_scheduling_plugins, ctx)
    if not legacy_metrics:
        ctx.attempt(warn_unused_data_sources, ctx)
    ctx.attempt(ctx.plugin_warnings)
    producers = ctx.attempt(ordered_producers, ctx)
    ctx.raise_errors()
    assert scheduler is not None and parsers is not None and data_sources is not None
    assert producers is not None
    hooks = request_hooks(ctx.plugins.values())
    return LoadedConfig(
        document=doc,
        scheduler=scheduler,
        plugins=dict(ctx.plugins),
        parsers=parsers,
        discovery=discovery,
        data_sources=data_sources,
        feature_gates=gates,
        saturation_detector=saturation_detector,
        pre_request=hooks.pre_request,
        producers=producers,
        admitters=hooks.admitters,
        response_header=hooks.response_header,
        response_body=hooks.response_body,
        request_done=hooks.request_done,
        request_header=hooks.request_header,
        screeners=hooks.screeners,
        responders=hooks.responders,
        propagate_priority=doc.request_handler is not None and doc.request_handler.propagate_priority,
        warnings=ctx.warnings,
        source=ctx.source,
        cross_replica=cross_replica,
    )
