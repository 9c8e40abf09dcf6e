"""The raw ``EndpointPickerConfig`` document: dataclasses for each section and strict decoding.

Only the *shape* is checked here, with ``epp.framework.decode``; plugins, defaults and
cross-references are checked by the loading phases (``epp.config.loader``).
Every element carries ``path``, the dotted path of its YAML node, so that errors name the exact field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any

import yaml

from epp.framework.decode import (
    decode_bool,
    decode_int,
    decode_list,
    decode_mapping,
    decode_number,
    decode_str,
    kind_of,
)
from epp.framework.durations import parse_go_duration
from epp.framework.errors import ConfigError

API_VERSION = "llm-d.ai/v1"  # the current version: the internal form and the effective output
V1ALPHA1_API_VERSION = "llm-d.ai/v1alpha1"  # deprecated: converted to v1 when decoded
DEPRECATED_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"  # the older group, as v1alpha1
API_VERSIONS = (API_VERSION, V1ALPHA1_API_VERSION, DEPRECATED_API_VERSION)
KIND = "EndpointPickerConfig"

GATE_FLOW_CONTROL = "flowControl"
GATE_HA_POPULATE_NON_LEADER = "haPopulateNonLeaderDatastore"
GATE_LEGACY_METRICS = "enableLegacyMetrics"  # older configurations only
GATE_DATA_LAYER = "dataLayer"  # deprecated no-op
# Gate -> enabled when not listed. The first two are the reference's; the others older names.
FEATURE_GATES: dict[str, bool] = {
    GATE_FLOW_CONTROL: False,
    GATE_HA_POPULATE_NON_LEADER: True,
    GATE_LEGACY_METRICS: False,
    GATE_DATA_LAYER: False,
}


class ConfigSyntaxError(ConfigError):
    """A YAML/JSON syntax error (or duplicate key); ``line`` and ``column`` are 1-based."""

    def __init__(self, source: str, line: int, column: int, problem: str) -> None:
        super().__init__(
            "", f"failed to decode configuration JSON/YAML: line {line}, column {column}: {problem}"
        )
        self.source = source
        self.line = line
        self.column = column


# --- document dataclasses ----------------------------------------------------------------------


@dataclass(slots=True)
class PluginSpec:
    """One entry of ``plugins:``; ``name`` defaults to ``type``."""

    type: str
    name: str
    parameters: dict[str, Any] | None = None
    path: str = ""


@dataclass(slots=True)
class ProfilePluginSpec:
    """One entry of ``schedulingProfiles[i].plugins``; ``weight`` only matters for scorers."""

    plugin_ref: str
    weight: float | None = None
    path: str = ""


@dataclass(slots=True)
class ProfileSpec:
    name: str
    plugins: list[ProfilePluginSpec] = field(default_factory=list)
    path: str = ""


@dataclass(slots=True)
class RefSpec:
    """A ``{pluginRef: name}`` section (parser, saturation detector, discovery, extractors)."""

    plugin_ref: str
    path: str = ""


@dataclass(slots=True)
class RequestHandlerSpec:
    """``requestHandler``: the parsers, matched per request by path suffix; ``propagatePriority``
    writes the request's priority into the body's ``priority`` field (engine-native scheduling)."""

    parsers: list[RefSpec] = field(default_factory=list)
    propagate_priority: bool = False


@dataclass(slots=True)
class DataSourceSpec:
    plugin_ref: str
    extractors: list[RefSpec] = field(default_factory=list)
    path: str = ""


@dataclass(slots=True)
class DataLayerSpec:
    inject_defaults: bool = True
    sources: list[DataSourceSpec] = field(default_factory=list)
    discovery: RefSpec | None = None
    peer_discovery: RefSpec | None = None
    cross_replica_syncer_plugin_ref: str | None = None
    cross_replica_sync_interval: Duration | None = None
    cross_replica_publish_timeout: Duration | None = None


@dataclass(slots=True, frozen=True)
class Quantity:
    """A Kubernetes resource quantity (``"1Gi"``, ``"1k"``, ``500``) as written and as an integer."""

    text: str
    value: int


@dataclass(slots=True, frozen=True)
class Duration:
    """A Go duration (``"30s"``, ``"1m30s"``, ``"200ms"``) as written and in seconds."""

    text: str
    seconds: float


@dataclass(slots=True)
class PriorityBandSpec:
    """A flow-control priority band (also the shape of ``defaultPriorityBand``)."""

    priority: int | None = None
    max_bytes: Quantity | None = None
    max_requests: Quantity | None = None
    fairness_policy_ref: str | None = None
    ordering_policy_ref: str | None = None
    default_request_ttl: Duration | None = None  # None: flowControl.defaultRequestTTL
    path: str = ""


@dataclass(slots=True)
class FlowControlSpec:
    """``flowControl``; ``None`` marks a field that was not given (the loader fills the defaults)."""

    max_bytes: Quantity | None = None
    max_requests: Quantity | None = None
    default_request_ttl: Duration | None = None
    no_endpoint_request_ttl: Duration | None = None
    default_priority_band: PriorityBandSpec | None = None
    default_negative_priority_band: PriorityBandSpec | None = None
    priority_bands: list[PriorityBandSpec] = field(default_factory=list)
    usage_limit_policy_plugin_ref: str | None = None
    saturation_detector: RefSpec | None = None
    enable_eviction: bool | None = None
    band_selection_policy_plugin_ref: str | None = None

    def has_settings(self) -> bool:
        """Whether anything but the saturation detector (honoured with the gate off) is set."""
        return (
            self.max_bytes is not None
            or self.max_requests is not None
            or self.default_request_ttl is not None
            or self.no_endpoint_request_ttl is not None
            or self.default_priority_band is not None
            or self.default_negative_priority_band is not None
            or bool(self.priority_bands)
            or bool(self.usage_limit_policy_plugin_ref)
            or bool(self.enable_eviction)
            or bool(self.band_selection_policy_plugin_ref)
        )


@dataclass(slots=True)
class ConfigDocument:
    """The internal form of a document of any accepted ``apiVersion`` (the v1 layout).

    ``api_version`` is the version as written until the loader has reported a deprecated one.
    """

    api_version: str = API_VERSION
    kind: str = KIND
    feature_gates: list[str] = field(default_factory=list)
    plugins: list[PluginSpec] = field(default_factory=list)
    scheduling_profiles: list[ProfileSpec] = field(default_factory=list)
    saturation_detector: RefSpec | None = None
    data_layer: DataLayerSpec = field(default_factory=DataLayerSpec)
    flow_control: FlowControlSpec | None = None
    parser: RefSpec | None = None  # deprecated: requestHandler.parsers
    request_handler: RequestHandlerSpec | None = None
    # plugins: entries that could not be decoded (their error is reported): name -> type
    invalid_plugins: dict[str, str] = field(default_factory=dict)


# --- YAML ----------------------------------------------------------------------------------------

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (strict decoding) instead of keeping the last one."""

    source = "<config>"


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            mark = key_node.start_mark
            raise ConfigSyntaxError(loader.source, mark.line + 1, mark.column + 1, f'duplicate key "{key}"')
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, source: str = "<config>") -> Any:
    """Parse YAML (or JSON) text; syntax errors raise ``ConfigSyntaxError`` with line and column."""
    loader = _StrictLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context or "invalid YAML"
        if mark is None:
            raise ConfigSyntaxError(source, 0, 0, problem) from None
        raise ConfigSyntaxError(source, mark.line + 1, mark.column + 1, problem) from None
    except yaml.reader.ReaderError as e:
        raise ConfigSyntaxError(source, 0, e.position + 1, e.reason) from None
    except yaml.YAMLError as e:
        raise ConfigSyntaxError(source, 0, 0, str(e)) from None
    finally:
        loader.dispose()


# --- optional values: an absent (null) field is Go's zero value ----------------------------------


def _mapping(value: Any, path: str, allowed: tuple[str, ...] | None) -> dict[str, Any]:
    """A mapping with only ``allowed`` keys; ``None`` (an empty YAML node) is an empty mapping."""
    return {} if value is None else decode_mapping(value, path, allowed)


def _list(value: Any, path: str) -> list[Any]:
    return [] if value is None else decode_list(value, path)


def _str(value: Any, path: str) -> str:
    """A string; ``None`` (absent) is the empty string, as Go's zero value."""
    return "" if value is None else decode_str(value, path)


def _opt_str(value: Any, path: str) -> str | None:
    return None if value is None else decode_str(value, path)


def _opt_bool(value: Any, path: str) -> bool | None:
    return None if value is None else decode_bool(value, path)


def _opt_int(value: Any, path: str) -> int | None:
    return None if value is None else decode_int(value, path)


def _opt_weight(value: Any, path: str) -> float | None:
    return None if value is None else decode_number(value, path, finite=True)


# --- quantities and durations ----------------------------------------------------------------------

_QUANTITY_RE = re.compile(
    r"^(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<exp>[eE][+-]?\d+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def parse_quantity(value: Any, path: str) -> Quantity | None:
    """A Kubernetes quantity, rounded up to an integer like Go's ``Quantity.Value()``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(path, f'expected a quantity such as "1Gi" or "500", got {kind_of(value)}')
    text = str(value).strip()
    m = _QUANTITY_RE.match(text)
    if m is None:
        raise ConfigError(path, f'invalid quantity {text!r} (examples: "1Gi", "500M", "1k", "100")')
    try:
        number = Decimal(m["num"])
        if m["exp"]:
            number *= Decimal(10) ** int(m["exp"][1:])
        elif m["suffix"] in _BINARY:
            number *= _BINARY[m["suffix"]]
        else:
            number *= _DECIMAL[m["suffix"] or ""]
    except (InvalidOperation, OverflowError):
        raise ConfigError(path, f"invalid quantity {text!r}") from None
    return Quantity(text, int(number.to_integral_value(rounding=ROUND_CEILING)))


def parse_duration(value: Any, path: str) -> Duration | None:
    """A Go duration string (``"1h30m"``, ``"200ms"``, ``"-5s"``; ``0`` alone needs no unit)."""
    if value is None:
        return None
    if value == 0 and not isinstance(value, bool):
        return Duration("0s", 0.0)
    if not isinstance(value, str):
        raise ConfigError(path, f'expected a duration string such as "30s", got {kind_of(value)} {value!r}')
    text = value.strip()
    seconds = parse_go_duration(text)
    if seconds is None:
        raise ConfigError(path, f'invalid duration {text!r} (examples: "30s", "1m30s", "200ms")')
    return Duration(text, seconds)


# --- document decoding --------------------------------------------------------------------------

# v1 has no top-level parser or saturationDetector (requestHandler.parsers and
# flowControl.saturationDetector replace them).
_TOP_FIELDS_V1 = (
    "apiVersion",
    "kind",
    "featureGates",
    "plugins",
    "schedulingProfiles",
    "dataLayer",
    "flowControl",
    "requestHandler",
)
_TOP_FIELDS_V1ALPHA1 = (*_TOP_FIELDS_V1, "saturationDetector", "parser")
_BAND_FIELDS = (
    "priority",
    "maxBytes",
    "maxRequests",
    "fairnessPolicyRef",
    "orderingPolicyRef",
    "defaultRequestTTL",
)
_FLOW_FIELDS = (
    "maxBytes",
    "maxRequests",
    "defaultRequestTTL",
    "noEndpointRequestTTL",
    "defaultPriorityBand",
    "defaultNegativePriorityBand",
    "priorityBands",
    "usageLimitPolicyPluginRef",
    "saturationDetector",
    "enableEviction",
    "bandSelectionPolicyPluginRef",
)
_DATA_LAYER_FIELDS_V1 = ("injectDefaults", "sources", "discovery", "crossReplica")
_DATA_LAYER_FIELDS_V1ALPHA1 = (
    "injectDefaults",
    "sources",
    "discovery",
    "peerDiscovery",
    "crossReplicaSyncerPluginRef",
    "crossReplicaSyncInterval",
    "crossReplicaPublishTimeout",
)
_CROSS_REPLICA_FIELDS = ("syncerPluginRef", "syncInterval", "publishTimeout")


def _api_version(top: dict[str, Any]) -> str:
    api_version = _str(top.get("apiVersion"), "apiVersion")
    if api_version in API_VERSIONS:
        return api_version
    expected = f"expected '{API_VERSION}' or '{V1ALPHA1_API_VERSION}'"
    if not api_version:
        raise ConfigError("apiVersion", f"apiVersion missing ({expected})")
    raise ConfigError("apiVersion", f"unknown apiVersion '{api_version}' ({expected})")


def decode_document(raw: Any, errors: list[ConfigError] | None = None) -> ConfigDocument:
    """Decode a parsed document strictly into the internal (v1) form; ``apiVersion`` and ``kind``
    are checked here.

    ``llm-d.ai/v1`` takes the v1 layout only; ``llm-d.ai/v1alpha1`` (and the older group) takes its
    own layout, converted here: ``dataLayer.discovery.pluginRef`` and ``dataLayer.peerDiscovery``
    become ``discovery.endpoints`` and ``discovery.peers`` (an explicit ``endpoints``/``peers`` wins),
    ``crossReplica*`` become ``crossReplica``; the top-level ``parser`` and ``saturationDetector`` are
    kept for the loader, which moves them with a warning. An unknown top-level or structural field is
    an error; plugin ``parameters`` stay raw (a mapping or ``None``) until each plugin's typed
    ``Params`` decodes them.

    With ``errors``, every independent problem (an unknown top-level field, a plugin entry, a
    profile entry, a section) is appended there and decoding goes on without that part (a plugin
    entry left out is named in ``invalid_plugins``); only a document that is not a mapping or has
    no known ``apiVersion`` still raises. Without it, the first problem is raised.
    """
    if errors is None:
        found: list[ConfigError] = []
        doc = decode_document(raw, found)
        if found:
            raise found[0]
        return doc
    if not isinstance(raw, dict):
        raise ConfigError("", f"expected a mapping at the top level, got {kind_of(raw)}")
    api_version = _api_version(raw)
    v1 = api_version == API_VERSION
    top = _known(raw, "", _TOP_FIELDS_V1 if v1 else _TOP_FIELDS_V1ALPHA1, errors)
    kind = _attempt(errors, "", _str, top.get("kind"), "kind")
    if kind != KIND:
        got = f"'{kind}'" if kind else "missing"
        errors.append(ConfigError("kind", f"unknown kind {got} (expected '{KIND}')"))
    gates = [
        gate
        for i, raw_gate in enumerate(_attempt(errors, [], _list, top.get("featureGates"), "featureGates"))
        if (gate := _attempt(errors, None, _str, raw_gate, f"featureGates[{i}]")) is not None
    ]
    plugins: list[PluginSpec] = []
    invalid: dict[str, str] = {}
    for i, p in enumerate(_attempt(errors, [], _list, top.get("plugins"), "plugins")):
        try:
            plugins.append(_plugin(p, f"plugins[{i}]"))
        except ConfigError as e:
            errors.append(e)
            if isinstance(p, dict):
                type_name = p.get("type") if isinstance(p.get("type"), str) else ""
                name = p.get("name") if isinstance(p.get("name"), str) and p.get("name") else type_name
                invalid[str(name)] = str(type_name)
    profiles = [
        prof
        for i, p in enumerate(
            _attempt(errors, [], _list, top.get("schedulingProfiles"), "schedulingProfiles")
        )
        if (prof := _attempt(errors, None, _profile, p, f"schedulingProfiles[{i}]", errors)) is not None
    ]
    data_layer = _data_layer_v1 if v1 else _data_layer_v1alpha1
    return ConfigDocument(
        api_version=api_version,
        kind=kind or "",
        feature_gates=gates,
        plugins=plugins,
        scheduling_profiles=profiles,
        saturation_detector=_attempt(
            errors, None, _detector_ref, top.get("saturationDetector"), "saturationDetector"
        ),
        data_layer=_attempt(errors, None, data_layer, top.get("dataLayer"), "dataLayer") or DataLayerSpec(),
        flow_control=(
            _attempt(errors, None, _flow_control, top["flowControl"], "flowControl")
            if "flowControl" in top
            else None
        ),
        parser=_attempt(errors, None, _ref_section, top, "parser"),
        request_handler=(
            _attempt(errors, None, _request_handler, top["requestHandler"])
            if "requestHandler" in top
            else None
        ),
        invalid_plugins=invalid,
    )


def _attempt(errors: list[ConfigError], failed: Any, decode: Callable[..., Any], *args: Any) -> Any:
    """``decode(*args)``; on a ``ConfigError`` the error goes to ``errors`` and ``failed`` is returned."""
    try:
        return decode(*args)
    except ConfigError as e:
        errors.append(e)
        return failed


def _known(value: Any, path: str, allowed: tuple[str, ...], errors: list[ConfigError]) -> dict[str, Any]:
    """A mapping reduced to its ``allowed`` keys; each other key is an error in ``errors``."""
    m = _mapping(value, path, None)
    kept: dict[str, Any] = {}
    for key, item in m.items():
        try:
            _mapping({key: item}, path, allowed)
        except ConfigError as e:
            errors.append(e)
            continue
        kept[key] = item
    return kept


def _plugin(raw: Any, path: str) -> PluginSpec:
    m = _mapping(raw, path, ("name", "type", "parameters"))
    type_name = _str(m.get("type"), f"{path}.type")
    name = _str(m.get("name"), f"{path}.name") or type_name
    params = m.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{path}.parameters", f"parameters must be a mapping, got {kind_of(params)}")
    return PluginSpec(type=type_name, name=name, parameters=params, path=path)


def _profile(raw: Any, path: str, errors: list[ConfigError]) -> ProfileSpec:
    """A profile; an unknown field or a malformed ``plugins`` entry is an error in ``errors`` and
    left out, the rest of the profile is kept."""
    m = _known(raw, path, ("name", "plugins"), errors)
    refs = []
    for j, r in enumerate(_attempt(errors, [], _list, m.get("plugins"), f"{path}.plugins")):
        rpath = f"{path}.plugins[{j}]"
        try:
            rm = _mapping(r, rpath, ("pluginRef", "weight"))
            refs.append(
                ProfilePluginSpec(
                    plugin_ref=_str(rm.get("pluginRef"), f"{rpath}.pluginRef"),
                    weight=_opt_weight(rm.get("weight"), f"{rpath}.weight"),
                    path=rpath,
                )
            )
        except ConfigError as e:
            errors.append(e)
    return ProfileSpec(
        name=_attempt(errors, "", _str, m.get("name"), f"{path}.name"), plugins=refs, path=path
    )


def _ref(raw: Any, path: str) -> RefSpec:
    m = _mapping(raw, path, ("pluginRef",))
    return RefSpec(plugin_ref=_str(m.get("pluginRef"), f"{path}.pluginRef"), path=path)


def _ref_section(top: dict[str, Any], key: str) -> RefSpec | None:
    """A ``{pluginRef}`` section; ``None`` when absent or null (the loader applies the default)."""
    return None if top.get(key) is None else _ref(top[key], key)


def _request_handler(raw: Any) -> RequestHandlerSpec:
    path = "requestHandler"
    m = _mapping(raw, path, ("parsers", "propagatePriority"))
    return RequestHandlerSpec(
        parsers=[
            _ref(p, f"{path}.parsers[{i}]") for i, p in enumerate(_list(m.get("parsers"), f"{path}.parsers"))
        ],
        propagate_priority=_opt_bool(m.get("propagatePriority"), f"{path}.propagatePriority") is True,
    )


def _sources(m: dict[str, Any], path: str) -> list[DataSourceSpec]:
    sources = []
    for i, s in enumerate(_list(m.get("sources"), f"{path}.sources")):
        spath = f"{path}.sources[{i}]"
        sm = _mapping(s, spath, ("pluginRef", "extractors"))
        extractors = [
            _ref(e, f"{spath}.extractors[{j}]")
            for j, e in enumerate(_list(sm.get("extractors"), f"{spath}.extractors"))
        ]
        sources.append(
            DataSourceSpec(
                plugin_ref=_str(sm.get("pluginRef"), f"{spath}.pluginRef"), extractors=extractors, path=spath
            )
        )
    return sources


def _discovery(
    raw: Any, path: str, *, bare_ref: bool
) -> tuple[RefSpec | None, RefSpec | None, RefSpec | None]:
    """``discovery``: ``(endpoints, peers, bare pluginRef)``; the bare form is v1alpha1's only."""
    if raw is None:
        return None, None, None
    allowed = ("endpoints", "peers", "pluginRef") if bare_ref else ("endpoints", "peers")
    m = _mapping(raw, path, allowed)
    bare = None
    if bare_ref and m.get("pluginRef") is not None:
        bare = RefSpec(plugin_ref=_str(m["pluginRef"], f"{path}.pluginRef"), path=path)
    return (
        _opt_ref(m.get("endpoints"), f"{path}.endpoints"),
        _opt_ref(m.get("peers"), f"{path}.peers"),
        bare,
    )


def _data_layer_v1(raw: Any, path: str) -> DataLayerSpec:
    m = _mapping(raw, path, _DATA_LAYER_FIELDS_V1)
    endpoints, peers, _ = _discovery(m.get("discovery"), f"{path}.discovery", bare_ref=False)
    cpath = f"{path}.crossReplica"
    cross = _mapping(m.get("crossReplica"), cpath, _CROSS_REPLICA_FIELDS)
    return DataLayerSpec(
        inject_defaults=_opt_bool(m.get("injectDefaults"), f"{path}.injectDefaults") is not False,
        sources=_sources(m, path),
        discovery=endpoints,
        peer_discovery=peers,
        cross_replica_syncer_plugin_ref=_opt_str(cross.get("syncerPluginRef"), f"{cpath}.syncerPluginRef"),
        cross_replica_sync_interval=parse_duration(cross.get("syncInterval"), f"{cpath}.syncInterval"),
        cross_replica_publish_timeout=parse_duration(cross.get("publishTimeout"), f"{cpath}.publishTimeout"),
    )


def _data_layer_v1alpha1(raw: Any, path: str) -> DataLayerSpec:
    m = _mapping(raw, path, _DATA_LAYER_FIELDS_V1ALPHA1)
    endpoints, peers, bare = _discovery(m.get("discovery"), f"{path}.discovery", bare_ref=True)
    return DataLayerSpec(
        inject_defaults=_opt_bool(m.get("injectDefaults"), f"{path}.injectDefaults") is not False,
        sources=_sources(m, path),
        discovery=endpoints or bare,
        peer_discovery=peers or _opt_ref(m.get("peerDiscovery"), f"{path}.peerDiscovery"),
        cross_replica_syncer_plugin_ref=_opt_str(
            m.get("crossReplicaSyncerPluginRef"), f"{path}.crossReplicaSyncerPluginRef"
        ),
        cross_replica_sync_interval=parse_duration(
            m.get("crossReplicaSyncInterval"), f"{path}.crossReplicaSyncInterval"
        ),
        cross_replica_publish_timeout=parse_duration(
            m.get("crossReplicaPublishTimeout"), f"{path}.crossReplicaPublishTimeout"
        ),
    )


# The thresholds a saturationDetector section held before the detector became a plugin (GIE #2704,
# router v0.9.0): now the utilization-detector plugin's parameters of the same names.
_OLD_DETECTOR_FIELDS = ("queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold")


def _detector_ref(raw: Any, path: str) -> RefSpec | None:
    """A saturationDetector ``{pluginRef}``; a pre-v0.9 threshold is refused naming its new place."""
    if isinstance(raw, dict):
        for key in _OLD_DETECTOR_FIELDS:
            if key in raw:
                raise ConfigError(
                    f"{path}.{key}",
                    f'unknown field "{key}" (moved to the utilization-detector plugin\'s parameters '
                    f"in llm-d-router v0.9.0: declare `{{type: utilization-detector, parameters: "
                    f"{{{key}: ...}}}}` under plugins and set {path}.pluginRef to it)",
                )
    return _opt_ref(raw, path)


def _opt_ref(raw: Any, path: str) -> RefSpec | None:
    return None if raw is None else _ref(raw, path)


def _band(raw: Any, path: str) -> PriorityBandSpec:
    m = _mapping(raw, path, _BAND_FIELDS)
    return PriorityBandSpec(
        priority=_opt_int(m.get("priority"), f"{path}.priority"),
        max_bytes=parse_quantity(m.get("maxBytes"), f"{path}.maxBytes"),
        max_requests=parse_quantity(m.get("maxRequests"), f"{path}.maxRequests"),
        fairness_policy_ref=_opt_str(m.get("fairnessPolicyRef"), f"{path}.fairnessPolicyRef"),
        ordering_policy_ref=_opt_str(m.get("orderingPolicyRef"), f"{path}.orderingPolicyRef"),
        default_request_ttl=parse_duration(m.get("defaultRequestTTL"), f"{path}.defaultRequestTTL"),
        path=path,
    )


def _opt_band(raw: Any, path: str) -> PriorityBandSpec | None:
    return None if raw is None else _band(raw, path)


def _flow_control(raw: Any, path: str) -> FlowControlSpec:
    m = _mapping(raw, path, _FLOW_FIELDS)
    return FlowControlSpec(
        max_bytes=parse_quantity(m.get("maxBytes"), f"{path}.maxBytes"),
        max_requests=parse_quantity(m.get("maxRequests"), f"{path}.maxRequests"),
        default_request_ttl=parse_duration(m.get("defaultRequestTTL"), f"{path}.defaultRequestTTL"),
        no_endpoint_request_ttl=parse_duration(m.get("noEndpointRequestTTL"), f"{path}.noEndpointRequestTTL"),
        default_priority_band=_opt_band(m.get("defaultPriorityBand"), f"{path}.defaultPriorityBand"),
        default_negative_priority_band=_opt_band(
            m.get("defaultNegativePriorityBand"), f"{path}.defaultNegativePriorityBand"
        ),
        priority_bands=[
            _band(b, f"{path}.priorityBands[{i}]")
            for i, b in enumerate(_list(m.get("priorityBands"), f"{path}.priorityBands"))
        ],
        usage_limit_policy_plugin_ref=_opt_str(
            m.get("usageLimitPolicyPluginRef"), f"{path}.usageLimitPolicyPluginRef"
        ),
        saturation_detector=_detector_ref(m.get("saturationDetector"), f"{path}.saturationDetector"),
        enable_eviction=_opt_bool(m.get("enableEviction"), f"{path}.enableEviction"),
        band_selection_policy_plugin_ref=_opt_str(
            m.get("bandSelectionPolicyPluginRef"), f"{path}.bandSelectionPolicyPluginRef"
        ),
    )
