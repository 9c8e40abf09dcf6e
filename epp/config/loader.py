"""Loading an ``EndpointPickerConfig``: instantiation, system defaults, validation, runtime objects.

Pipeline (scheduling.md §3.2), each step raising ``ConfigError(field, reason)`` with the exact
dotted path of the offending element and the reference's message text:

1. Parse and strictly decode the document (``epp.config.schema``); no text → the default document
   (``epp.config.defaults``). Validate ``featureGates``.
2. Instantiate ``plugins`` in list order: ``registry.lookup(type)``, ``decode_params`` of the typed
   ``Params``, then ``cls(name, params, handle)``. The handle resolves plugins declared *earlier*
   (that is why deciders precede the disagg handler) and the current endpoints.
3. Validate profile names and references, then apply the system defaults: a ``default`` profile
   holding every filter, scorer and picker (saturation detectors excepted) when there are no
   profiles; ``single-profile-handler`` for exactly one profile without a handler; a picker (the
   first picker instance, else a new ``max-score-picker``) for profiles without one; weight 1.0 for
   weightless scorers; flow-control policies, the parser, the saturation detector (default
   ``utilization-detector``, not used as a filter) and the metrics data source. Defaults whose type
   is not registered in this build are skipped, except the parser, which is required.
4. Create producers for consumed-but-unproduced data keys (§1.8), forwarding the consumer's matching
   parameters (quirk D5), and order producers so that each runs after the producers it consumes
   from (otherwise in ``plugins:`` order).
5. Build the scheduler (each referenced plugin goes into every slot it implements; one picker per
   profile; exactly one profile handler among all instances), the data-layer sources, discovery,
   and check the flow-control section when the ``flowControl`` gate is on.
6. Hook every instance into request control by the interfaces it implements, in ``plugins:`` order
   (quirk D7: the reference's order is map iteration, i.e. random).

The loader also records the *effective* document (every default filled in), rendered by
``LoadedConfig.effective_yaml()``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import epp.plugins  # noqa: F401 - the composition root registers the built-in plugin types
from epp.config import defaults as d
from epp.config.effective import render_effective
from epp.config.schema import (
    API_VERSION,
    DEPRECATED_API_VERSION,
    FEATURE_GATES,
    GATE_DATA_LAYER,
    GATE_FLOW_CONTROL,
    GATE_LEGACY_METRICS,
    ConfigDocument,
    DataSourceSpec,
    FlowControlSpec,
    PluginSpec,
    PriorityBandSpec,
    ProfilePluginSpec,
    ProfileSpec,
    Quantity,
    RefSpec,
    decode_document,
    parse_yaml,
)
from epp.framework import registry
from epp.framework.endpoint import Endpoint
from epp.framework.errors import ConfigError
from epp.framework.interfaces import (
    Admitter,
    DataProducer,
    DataSource,
    EndpointDiscovery,
    Extractor,
    Filter,
    Parser,
    Picker,
    Plugin,
    PreRequest,
    ProfileHandler,
    RequestDone,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
    Scorer,
)
from epp.framework.params import decode_params, yaml_key
from epp.scheduling import Scheduler, SchedulerProfile, WeightedScorer

EndpointsFn = Callable[[], Sequence[Endpoint]]

# Deprecated environment switch that appends the flowControl gate (scheduling.md §3.1).
FLOW_CONTROL_ENV = "ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER"


@dataclass(slots=True)
class LoadedConfig:
    """Everything the runner needs from a configuration, plus its effective document."""

    document: ConfigDocument
    scheduler: Scheduler
    plugins: dict[str, Plugin]
    parser: Parser
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
    warnings: list[str] = field(default_factory=list)
    source: str = "<config>"

    @property
    def needs_response_body(self) -> bool:
        """Whether any ResponseBodyProcessor is configured (the EPP must then stream response bodies)."""
        return bool(self.response_body)

    @property
    def flow_control_enabled(self) -> bool:
        return GATE_FLOW_CONTROL in self.feature_gates

    def effective_yaml(self) -> str:
        """The effective configuration as YAML: defaults filled in, effective plugin parameters."""
        return render_effective(self.document, self.plugins)


def load_config(
    text: str | None,
    source: str = "<config>",
    *,
    endpoints: EndpointsFn | None = None,
    environ: Mapping[str, str] | None = None,
) -> LoadedConfig:
    """Load a configuration from YAML/JSON text; ``None``, empty or comment-only → the default one.

    ``endpoints`` is what plugin factories see as ``handle.endpoints()`` (default: none).
    ``environ`` defaults to ``os.environ`` (read for ``ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER``).
    """
    raw: Any = None
    if text is not None and text.strip():
        raw = parse_yaml(text, source)
    if raw is None:
        raw = d.default_document()
    return load_document(raw, source, endpoints=endpoints, environ=environ)


def load_config_file(
    path: str, *, endpoints: EndpointsFn | None = None, environ: Mapping[str, str] | None = None
) -> LoadedConfig:
    """Load a configuration file (``--config-file``); error messages name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read config file {path}: {e}") from None
    return load_config(text, path, endpoints=endpoints, environ=environ)


def load_document(
    raw: Any,
    source: str = "<config>",
    *,
    endpoints: EndpointsFn | None = None,
    environ: Mapping[str, str] | None = None,
) -> LoadedConfig:
    """Load an already parsed document (a dict as produced by YAML)."""
    doc = decode_document(_with_default_scheduling(raw))
    return _Loader(doc, source, endpoints, os.environ if environ is None else environ).load()


def _with_default_scheduling(raw: Any) -> Any:
    """Give a config that declares no scheduling at all the default scheduling.

    Differs from the reference on purpose: there, a config without profiles gets one profile of
    whatever filters, scorers and pickers it declares, so a file that only sets up discovery (or a
    data source) routes at random. Users expect the default profile (queue-scorer x2,
    kv-cache-utilization-scorer x2, prefix-cache-scorer x3), which is what an empty config gets.
    Applies only when there are no ``schedulingProfiles`` and no filter, scorer, picker or profile
    handler among the plugins.
    """
    if not isinstance(raw, dict) or raw.get("schedulingProfiles"):
        return raw
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(p, dict) for p in plugins):
        return raw  # malformed: let strict decoding report it
    scheduling_kinds = (Filter, Scorer, Picker, ProfileHandler)
    for p in plugins:
        cls = registry.lookup(str(p.get("type", "")))
        # A saturation detector (also a Filter) declared to tune admission is not scheduling.
        if cls is not None and issubclass(cls, scheduling_kinds) and not issubclass(cls, SaturationDetector):
            return raw
    default = d.default_document()
    taken = {p.get("name") or p.get("type") for p in plugins}
    added = []
    for p in default["plugins"]:
        cls = registry.lookup(p["type"])
        if cls is not None and issubclass(cls, (*scheduling_kinds, DataProducer)) and p["type"] not in taken:
            added.append(p)
    return {**raw, "plugins": [*plugins, *added], "schedulingProfiles": default["schedulingProfiles"]}


class _Handle:
    """The factory handle: plugins created so far (i.e. declared earlier) and the live endpoints."""

    __slots__ = ("_endpoints", "_plugins")

    def __init__(self, plugins: Mapping[str, Plugin], endpoints: EndpointsFn) -> None:
        self._plugins = plugins
        self._endpoints = endpoints

    def plugin(self, name: str) -> Plugin | None:
        return self._plugins.get(name)

    def endpoints(self) -> Sequence[Endpoint]:
        return self._endpoints()


def _no_endpoints() -> Sequence[Endpoint]:
    return ()


def _factory_error(spec: PluginSpec, exc: Exception) -> ConfigError:
    """Wrap a factory failure so that the field names the plugin.

    A ``ConfigError`` raised by a factory names its field relative to the plugin's ``parameters``
    (``deciders.prefill``), unless it already is a full path (``plugins[...]``) or is empty.
    """
    prefix = f"failed to create plugin '{spec.name}' (type: {spec.type})"
    if isinstance(exc, ConfigError):
        if not exc.field:
            where = spec.path
        elif exc.field.startswith("plugins["):
            where = exc.field
        else:
            where = f"{spec.path}.parameters.{exc.field}"
        return ConfigError(where, f"{prefix}: {exc.reason}")
    return ConfigError(spec.path, f"{prefix}: {exc}")


def _consumes(plugin: Plugin) -> frozenset[str]:
    """Data keys a plugin consumes: its optional ``consumes`` class attribute (not in the contract)."""
    keys = getattr(plugin, "consumes", None)
    if isinstance(keys, str) or not isinstance(keys, Iterable):
        return frozenset()
    return frozenset(k for k in keys if isinstance(k, str))


def _produces(plugin: Plugin) -> frozenset[str]:
    return plugin.produces if isinstance(plugin, DataProducer) else frozenset()


def _ref_field(ref: ProfilePluginSpec) -> str:
    """Error field of a profile entry; entries of the implicit default profile name their plugin."""
    return ref.path if ref.path.startswith("plugins[") else f"{ref.path}.pluginRef"


class _Loader:
    def __init__(
        self, doc: ConfigDocument, source: str, endpoints: EndpointsFn | None, environ: Mapping[str, str]
    ) -> None:
        self.doc = doc
        self.source = source
        self.environ = environ
        self.warnings: list[str] = []
        self.plugins: dict[str, Plugin] = {}
        self.specs: dict[str, PluginSpec] = {}
        self.handle = _Handle(self.plugins, endpoints or _no_endpoints)

    def load(self) -> LoadedConfig:
        doc = self.doc
        if doc.api_version == DEPRECATED_API_VERSION:
            self.warnings.append(f"apiVersion '{DEPRECATED_API_VERSION}' is deprecated; use '{API_VERSION}'")
            doc.api_version = API_VERSION
        gates = self._feature_gates()
        legacy_metrics = GATE_LEGACY_METRICS in gates
        for spec in doc.plugins:
            self._instantiate(spec, legacy_metrics)
        self._validate_profiles()
        self._apply_scheduling_defaults()
        self._apply_flow_control_defaults()
        parser = self._resolve_parser()
        saturation_detector = self._resolve_saturation_detector()
        if not legacy_metrics:
            self._apply_data_layer_defaults()
        self._create_missing_producers()
        scheduler = self._build_scheduler()
        data_sources = [] if legacy_metrics else self._build_data_layer()
        discovery = self._resolve_discovery()
        if GATE_FLOW_CONTROL in gates:
            self._check_flow_control()
        self._warn_multi_endpoint_pickers(scheduler)
        plugins = list(self.plugins.values())
        return LoadedConfig(
            document=doc,
            scheduler=scheduler,
            plugins=dict(self.plugins),
            parser=parser,
            discovery=discovery,
            data_sources=data_sources,
            feature_gates=gates,
            saturation_detector=saturation_detector,
            pre_request=[p for p in plugins if isinstance(p, PreRequest)],
            producers=self._ordered_producers(),
            admitters=[p for p in plugins if isinstance(p, Admitter)],
            response_header=[p for p in plugins if isinstance(p, ResponseHeaderProcessor)],
            response_body=[p for p in plugins if isinstance(p, ResponseBodyProcessor)],
            request_done=[p for p in plugins if isinstance(p, RequestDone)],
            warnings=self.warnings,
            source=self.source,
        )

    # --- phase 1 ------------------------------------------------------------------------------

    def _feature_gates(self) -> frozenset[str]:
        gates: list[str] = []
        for i, gate in enumerate(self.doc.feature_gates):
            if gate not in FEATURE_GATES:
                raise ConfigError(f"featureGates[{i}]", f"feature gate '{gate}' is unknown or unregistered")
            if gate not in gates:
                gates.append(gate)
        if self.environ.get(FLOW_CONTROL_ENV, "").strip().lower() in ("1", "t", "true"):
            self.warnings.append(
                f"{FLOW_CONTROL_ENV} is deprecated; add '{GATE_FLOW_CONTROL}' to featureGates"
            )
            if GATE_FLOW_CONTROL not in gates:
                gates.append(GATE_FLOW_CONTROL)
        if GATE_DATA_LAYER in gates:
            self.warnings.append(f"feature gate '{GATE_DATA_LAYER}' is deprecated and has no effect")
        self.doc.feature_gates = gates
        return frozenset(gates)

    # --- instantiation ------------------------------------------------------------------------

    def _instantiate(self, spec: PluginSpec, legacy_metrics: bool) -> Plugin:
        if not spec.type:
            raise ConfigError(f"{spec.path}.type", f"plugin '{spec.name}' is missing a type")
        if spec.name in self.plugins:
            raise ConfigError(f"{spec.path}.name", f"duplicate plugin name '{spec.name}'")
        cls = registry.lookup(spec.type)
        if cls is None:
            raise ConfigError(f"{spec.path}.type", f"plugin type '{spec.type}' is not registered")
        if legacy_metrics and cls.type_name == d.CORE_METRICS_EXTRACTOR:
            raise ConfigError(
                f"{spec.path}.type",
                f"{d.CORE_METRICS_EXTRACTOR} is not allowed with feature gate '{GATE_LEGACY_METRICS}'",
            )
        params = decode_params(cls.Params, spec.parameters, f"{spec.path}.parameters")
        try:
            plugin = cls(spec.name, params, self.handle)
        except (ConfigError, ValueError) as e:
            raise _factory_error(spec, e) from e
        self.plugins[spec.name] = plugin
        self.specs[spec.name] = spec
        return plugin

    def _add_default(self, type_name: str, what: str, parameters: dict[str, Any] | None = None) -> Plugin:
        """Instantiate a system default named after its type and append it to ``plugins``."""
        if registry.lookup(type_name) is None:
            raise ConfigError(
                "plugins", f"failed to apply {what} defaults: plugin type '{type_name}' not found in registry"
            )
        spec = PluginSpec(
            type=type_name, name=type_name, parameters=parameters, path=f"plugins[{len(self.doc.plugins)}]"
        )
        self.doc.plugins.append(spec)
        try:
            return self._instantiate(spec, legacy_metrics=False)
        except ConfigError as e:
            raise ConfigError(
                e.field, f"failed to instantiate default plugin '{type_name}': {e.reason}"
            ) from e

    # --- scheduling ---------------------------------------------------------------------------

    def _validate_profiles(self) -> None:
        seen: set[str] = set()
        for i, prof in enumerate(self.doc.scheduling_profiles):
            if not prof.name:
                raise ConfigError(f"{prof.path}.name", f"schedulingProfiles[{i}] is missing a name")
            if prof.name in seen:
                raise ConfigError(
                    f"{prof.path}.name", f"schedulingProfiles[{i}] has duplicate name '{prof.name}'"
                )
            seen.add(prof.name)
            for j, ref in enumerate(prof.plugins):
                if not ref.plugin_ref:
                    raise ConfigError(
                        f"{ref.path}.pluginRef",
                        f"schedulingProfiles[{prof.name}].plugins[{j}] is missing a 'pluginRef'",
                    )
                if ref.plugin_ref not in self.plugins:
                    raise ConfigError(
                        f"{ref.path}.pluginRef",
                        f"schedulingProfiles[{prof.name}] references undefined plugin '{ref.plugin_ref}'",
                    )

    def _apply_scheduling_defaults(self) -> None:
        profiles = self.doc.scheduling_profiles
        if not profiles:
            # Differs from the reference, which also puts saturation detectors (they are filters)
            # into the implicit profile: a detector declared to tune admission should not start
            # filtering endpoints unless a profile references it.
            refs = [
                ProfilePluginSpec(name, None, self.specs[name].path)
                for name, p in self.plugins.items()
                if isinstance(p, Filter | Scorer | Picker) and not isinstance(p, SaturationDetector)
            ]
            profiles.append(ProfileSpec(d.DEFAULT_PROFILE_NAME, refs, "schedulingProfiles[0]"))
        if len(profiles) == 1 and not any(isinstance(p, ProfileHandler) for p in self.plugins.values()):
            self._add_default(d.SINGLE_PROFILE_HANDLER, "scheduling")
        lacking = [
            prof
            for prof in profiles
            if not any(isinstance(self.plugins[r.plugin_ref], Picker) for r in prof.plugins)
        ]
        if lacking:
            name = next((n for n, p in self.plugins.items() if isinstance(p, Picker)), "")
            if not name:
                name = self._add_default(d.DEFAULT_PICKER, "scheduling").name
            for prof in lacking:
                where = f"{prof.path}.plugins[{len(prof.plugins)}]"
                prof.plugins.append(ProfilePluginSpec(name, None, where))
        for prof in profiles:
            for ref in prof.plugins:
                if ref.weight is None and isinstance(self.plugins[ref.plugin_ref], Scorer):
                    ref.weight = 1.0

    def _assemble_profile(self, prof: ProfileSpec) -> SchedulerProfile:
        """A profile: each referenced plugin goes into every slot it implements (§1.4)."""
        sp = SchedulerProfile(prof.name)
        for ref in prof.plugins:
            plugin = self.plugins[ref.plugin_ref]
            what = f"plugin '{plugin.name}' ({plugin.type_name})"
            if isinstance(plugin, Filter):
                sp.filters.append(plugin)
            if isinstance(plugin, Scorer):
                sp.scorers.append(WeightedScorer(plugin, 1.0 if ref.weight is None else ref.weight))
            elif ref.weight is not None:
                self.warnings.append(f"{ref.path}.weight: ignored, {what} is not a scorer")
            if isinstance(plugin, Picker):
                if sp.picker is not None:
                    raise ConfigError(
                        _ref_field(ref),
                        f"failed to add plugin '{plugin.name}' to profile '{prof.name}': "
                        f"failed to set '{plugin.name}' as picker, "
                        f"already have a registered picker plugin '{sp.picker.name}'",
                    )
                sp.picker = plugin
            if not isinstance(plugin, Filter | Scorer | Picker):
                # The reference silently ignores it; say so, the user probably meant something else.
                self.warnings.append(
                    f"{_ref_field(ref)}: {what} is neither a filter, a scorer nor a picker "
                    f"and is ignored in profile '{prof.name}'"
                )
        return sp

    def _build_scheduler(self) -> Scheduler:
        profiles = {prof.name: self._assemble_profile(prof) for prof in self.doc.scheduling_profiles}
        handlers = [p for p in self.plugins.values() if isinstance(p, ProfileHandler)]
        if len(handlers) > 1:
            a, b = handlers[0].name, handlers[1].name
            raise ConfigError(
                self.specs[b].path, f"multiple profile handlers found ('{a}', '{b}'); only one is allowed"
            )
        if not handlers:
            raise ConfigError(
                "schedulingProfiles",
                f"no profile handler configured ({len(profiles)} scheduling profiles need one, "
                "e.g. disagg-profile-handler)",
            )
        handler = handlers[0]
        problem = handler.validate_profiles(list(profiles))
        if problem:
            raise ConfigError(self.specs[handler.name].path, problem)
        return Scheduler(handler, profiles)

    def _warn_multi_endpoint_pickers(self, scheduler: Scheduler) -> None:
        warned: set[str] = set()
        for sp in scheduler.profiles.values():
            picker = sp.picker
            if picker is None or picker.name in warned:
                continue
            n = getattr(picker.params, "max_num_of_endpoints", 1)
            if isinstance(n, int) and n > 1:
                warned.add(picker.name)
                self.warnings.append(
                    f"{self.specs[picker.name].path}.parameters.maxNumOfEndpoints: picker '{picker.name}' "
                    f"returns up to {n} endpoints as a comma-separated destination list, which Envoy's "
                    "ORIGINAL_DST cluster cannot parse (it answers 503); use 1 unless the proxy "
                    "implements fallback lists"
                )

    # --- other defaults -----------------------------------------------------------------------

    def _apply_flow_control_defaults(self) -> None:
        # Always instantiated when registered, even with flow control off (as in the reference).
        for type_name in d.FLOW_CONTROL_DEFAULTS:
            if type_name not in self.plugins and registry.lookup(type_name) is not None:
                self._add_default(type_name, "flow control")

    def _resolve_parser(self) -> Parser:
        ref = self.doc.parser
        if ref is None or not ref.plugin_ref:
            ref = self.doc.parser = RefSpec(d.DEFAULT_PARSER, "parser")
        where = f"{ref.path}.pluginRef"
        plugin = self.plugins.get(ref.plugin_ref)
        if plugin is None:
            if ref.plugin_ref != d.DEFAULT_PARSER:
                raise ConfigError(
                    where, f"the configured parser is not loaded: no plugin named '{ref.plugin_ref}'"
                )
            if registry.lookup(d.DEFAULT_PARSER) is None:
                raise ConfigError(
                    where,
                    "the configured parser is not loaded: "
                    f"plugin type '{d.DEFAULT_PARSER}' is not registered",
                )
            plugin = self._add_default(d.DEFAULT_PARSER, "parser")
        if not isinstance(plugin, Parser):
            raise ConfigError(
                where,
                f"the specified plugin is not a parser plugin in the config "
                f"('{plugin.name}' has type {plugin.type_name})",
            )
        return plugin

    def _resolve_saturation_detector(self) -> SaturationDetector | None:
        """The saturation detector, auto-created only when the ref is exactly ``utilization-detector``.

        Without a ``saturationDetector`` section the ref defaults to ``utilization-detector``: an
        instance of that name declared under ``plugins`` is used (with its parameters), otherwise
        one is created with the defaults. It is not added to any profile, so it is not a filter.
        """
        ref = self.doc.saturation_detector
        if ref is None:
            ref = self.doc.saturation_detector = RefSpec(d.DEFAULT_SATURATION_DETECTOR, "saturationDetector")
            if d.DEFAULT_SATURATION_DETECTOR not in self.plugins:
                if registry.lookup(d.DEFAULT_SATURATION_DETECTOR) is None:
                    self.doc.saturation_detector = None
                    return None  # not in this build: no saturation detector, no legacy shedding
                self._add_default(d.DEFAULT_SATURATION_DETECTOR, "saturation detector")
        where = f"{ref.path}.pluginRef"
        if not ref.plugin_ref:
            raise ConfigError(where, "saturation detector plugin reference is empty")
        plugin = self.plugins.get(ref.plugin_ref)
        if plugin is None:
            if (
                ref.plugin_ref == d.DEFAULT_SATURATION_DETECTOR
                and registry.lookup(ref.plugin_ref) is not None
            ):
                plugin = self._add_default(d.DEFAULT_SATURATION_DETECTOR, "saturation detector")
            else:
                raise ConfigError(
                    where, f"saturation detector references undefined plugin '{ref.plugin_ref}'"
                )
        if not isinstance(plugin, SaturationDetector):
            raise ConfigError(
                where,
                f"plugin '{ref.plugin_ref}' is not a fwkfc.SaturationDetector (type {plugin.type_name})",
            )
        return plugin

    # --- data layer ---------------------------------------------------------------------------

    def _is_metrics_source(self, src: DataSourceSpec) -> bool:
        # The reference checks the source name only; a renamed metrics-data-source instance counts too.
        plugin = self.plugins.get(src.plugin_ref)
        return src.plugin_ref == d.METRICS_DATA_SOURCE or (
            plugin is not None and plugin.type_name == d.METRICS_DATA_SOURCE
        )

    def _apply_data_layer_defaults(self) -> None:
        dl = self.doc.data_layer
        if not dl.inject_defaults or any(self._is_metrics_source(s) for s in dl.sources):
            return
        if d.METRICS_DATA_SOURCE not in self.plugins and registry.lookup(d.METRICS_DATA_SOURCE) is None:
            return  # not in this build yet
        if d.METRICS_DATA_SOURCE not in self.plugins:
            self._add_default(d.METRICS_DATA_SOURCE, "data layer")
        path = f"dataLayer.sources[{len(dl.sources)}]"
        source = DataSourceSpec(d.METRICS_DATA_SOURCE, [], path)
        extractor = d.CORE_METRICS_EXTRACTOR
        if extractor in self.plugins or registry.lookup(extractor) is not None:
            if extractor not in self.plugins:
                self._add_default(extractor, "data layer")
            source.extractors.append(RefSpec(extractor, f"{path}.extractors[0]"))
        dl.sources.append(source)

    def _build_data_layer(self) -> list[tuple[DataSource, list[Extractor]]]:
        out: list[tuple[DataSource, list[Extractor]]] = []
        dl = self.doc.data_layer
        for src in dl.sources:
            where = f"{src.path}.pluginRef"
            source = self._lookup_ref(src.plugin_ref, where, "data source")
            if not isinstance(source, DataSource):
                raise ConfigError(where, f"the plugin {src.plugin_ref} is not a fwkdl.DataSource")
            extractors: list[Extractor] = []
            for ext in src.extractors:
                ewhere = f"{ext.path}.pluginRef"
                extractor = self._lookup_ref(ext.plugin_ref, ewhere, "extractor")
                if not isinstance(extractor, Extractor):
                    # Quirk D19: the reference prints the source name here; name the extractor.
                    raise ConfigError(ewhere, f"the plugin {ext.plugin_ref} is not a fwkdl.ExtractorBase")
                extractors.append(extractor)
            out.append((source, extractors))
        if not out and not dl.inject_defaults:
            raise ConfigError("dataLayer.sources", "data layer enabled but no data sources configured")
        return out

    def _lookup_ref(self, ref: str, where: str, what: str) -> Plugin:
        if not ref:
            raise ConfigError(where, f"{what} plugin reference is empty")
        plugin = self.plugins.get(ref)
        if plugin is None:
            raise ConfigError(where, f"references undefined plugin '{ref}'")
        return plugin

    def _resolve_discovery(self) -> EndpointDiscovery | None:
        ref = self.doc.data_layer.discovery
        if ref is None:
            return None
        where = f"{ref.path}.pluginRef"
        if not ref.plugin_ref:
            raise ConfigError(where, "discovery plugin reference is empty")
        plugin = self.plugins.get(ref.plugin_ref)
        if plugin is None:
            raise ConfigError(where, f'no plugin found with name "{ref.plugin_ref}"')
        if not isinstance(plugin, EndpointDiscovery):
            raise ConfigError(where, f'plugin "{ref.plugin_ref}" does not implement EndpointDiscovery')
        return plugin

    # --- data producers (scheduling.md §1.8) -------------------------------------------------

    def _create_missing_producers(self) -> None:
        produced: set[str] = set()
        for p in self.plugins.values():
            produced |= _produces(p)
        consumers: dict[str, list[str]] = {}
        for name, p in self.plugins.items():
            for key in sorted(_consumes(p) - produced):
                consumers.setdefault(key, []).append(name)
        for key, names in consumers.items():
            type_name = d.AUTO_PRODUCERS.get(key)
            if type_name is None or key in produced:
                continue  # metric keys have no producer; or produced by a producer created above
            if any(p.type_name == type_name for p in self.plugins.values()):
                continue
            cls = registry.lookup(type_name)
            if cls is None:
                self.warnings.append(
                    f"plugin '{names[0]}' consumes {key}, which no plugin produces, and the producer "
                    f"type '{type_name}' is not registered in this build"
                )
                continue
            plugin = self._add_default(type_name, "data producer", self._forwarded_params(cls, names) or None)
            produced |= _produces(plugin) | {k for k, t in d.AUTO_PRODUCERS.items() if t == type_name}

    def _forwarded_params(self, cls: type[Plugin], consumers: list[str]) -> dict[str, Any]:
        """Quirk D5: parameters given to a consumer that the auto-created producer understands.

        The reference ignores ``prefix-cache-scorer``'s ``blockSizeTokens`` etc.; users expect them to
        take effect, so they are forwarded to the producer it creates (the first consumer wins).
        """
        if not dataclasses.is_dataclass(cls.Params):
            return {}
        known = {yaml_key(f) for f in dataclasses.fields(cls.Params)}
        out: dict[str, Any] = {}
        for name in consumers:
            for key, value in (self.specs[name].parameters or {}).items():
                if key not in known:
                    continue
                if key in out and out[key] != value:
                    self.warnings.append(
                        f"{self.specs[name].path}.parameters.{key}: conflicts with another consumer of "
                        f"'{cls.type_name}'; using {out[key]!r}"
                    )
                    continue
                out[key] = value
        return out

    def _ordered_producers(self) -> list[DataProducer]:
        """Producers in ``plugins:`` order, except that a producer runs after those it consumes from."""
        producers = [p for p in self.plugins.values() if isinstance(p, DataProducer)]
        deps = {
            p.name: {q.name for q in producers if q is not p and _consumes(p) & q.produces} for p in producers
        }
        ordered: list[DataProducer] = []
        placed: set[str] = set()
        pending = list(producers)
        while pending:
            ready = next((p for p in pending if deps[p.name] <= placed), None)
            if ready is None:
                raise ConfigError(self.specs[pending[0].name].path, "cycle detected: graph is not a DAG")
            pending.remove(ready)
            ordered.append(ready)
            placed.add(ready.name)
        return ordered

    # --- flow control -------------------------------------------------------------------------

    def _check_flow_control(self) -> None:
        """Validate ``flowControl`` (gate on) and fill its defaults into the effective document.

        Policy kinds are not checked: the framework has no flow-control interfaces yet.
        """
        fc = self.doc.flow_control
        if fc is None:
            fc = self.doc.flow_control = FlowControlSpec()
        for key, q in (("maxBytes", fc.max_bytes), ("maxRequests", fc.max_requests)):
            _non_negative(q, f"flowControl.{key}", key)
        ttl = fc.default_request_ttl
        if ttl is not None and ttl.seconds < 0:
            raise ConfigError(
                "flowControl.defaultRequestTTL", f"DefaultRequestTTL cannot be negative, but got {ttl.text}"
            )
        seen: set[int] = set()
        for band in fc.priority_bands:
            if band.priority is None:
                band.priority = 0
            if band.priority in seen:
                raise ConfigError(f"{band.path}.priority", f"duplicate priority level {band.priority}")
            seen.add(band.priority)
            self._check_band(band)
        if fc.default_priority_band is not None:
            self._check_band(fc.default_priority_band)
        ref = fc.usage_limit_policy_plugin_ref
        if ref is None:
            if d.DEFAULT_USAGE_LIMIT_POLICY in self.plugins:
                fc.usage_limit_policy_plugin_ref = d.DEFAULT_USAGE_LIMIT_POLICY
        elif ref not in self.plugins:
            raise ConfigError(
                "flowControl.usageLimitPolicyPluginRef", f"usage limit policy plugin '{ref}' not found"
            )
        if fc.enable_eviction is None:
            fc.enable_eviction = False

    def _check_band(self, band: PriorityBandSpec) -> None:
        _non_negative(band.max_bytes, f"{band.path}.maxBytes", "maxBytes")
        _non_negative(band.max_requests, f"{band.path}.maxRequests", "maxRequests")
        if band.max_bytes is None:
            band.max_bytes = Quantity(str(d.DEFAULT_BAND_MAX_BYTES), d.DEFAULT_BAND_MAX_BYTES)
        if band.max_requests is None:
            band.max_requests = Quantity(str(d.DEFAULT_BAND_MAX_REQUESTS), d.DEFAULT_BAND_MAX_REQUESTS)
        band.fairness_policy_ref = self._policy_ref(
            band.fairness_policy_ref, d.DEFAULT_FAIRNESS_POLICY, f"{band.path}.fairnessPolicyRef", "fairness"
        )
        band.ordering_policy_ref = self._policy_ref(
            band.ordering_policy_ref, d.DEFAULT_ORDERING_POLICY, f"{band.path}.orderingPolicyRef", "ordering"
        )

    def _policy_ref(self, ref: str | None, default: str, where: str, kind: str) -> str | None:
        if ref is None or ref == "":
            return default if default in self.plugins else None
        if ref not in self.plugins:
            raise ConfigError(where, f'no {kind} policy registered for name "{ref}"')
        return ref


def _non_negative(q: Quantity | None, where: str, name: str) -> None:
    if q is not None and q.value < 0:
        raise ConfigError(where, f"{name} must be non-negative, got {q.text}")
