"""Rendering the effective configuration as YAML (``epp check-config``): every default filled in.

The internal form is rendered in the v1 layout, or in the deprecated v1alpha1 one on request.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import yaml

from epp.config.schema import (
    API_VERSION,
    V1ALPHA1_API_VERSION,
    ConfigDocument,
    DataLayerSpec,
    FlowControlSpec,
    PriorityBandSpec,
    RefSpec,
)
from epp.framework.decode import yaml_key
from epp.framework.interfaces import Plugin, Scorer
from epp.framework.params import OMIT_UNSET, encode_params


def effective_params(params: Any) -> dict[str, Any]:
    """A plugin's parameters as ``check-config`` prints them: the values the plugin uses.

    Each Params dataclass's ``effective()`` is applied (the defaults it resolves, written out) and a
    field marked ``OMIT_UNSET`` is left out while it holds its default (``epp.framework.params``).
    """
    if not dataclasses.is_dataclass(params) or isinstance(params, type):
        return {}
    resolve = getattr(params, "effective", None)
    if callable(resolve):
        params = resolve()
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if _omit_unset(f) and value == _default(f):
            continue
        out[yaml_key(f)] = _effective_value(value)
    return out


def _omit_unset(f: dataclasses.Field[Any]) -> bool:
    return all(f.metadata.get(k) == v for k, v in OMIT_UNSET.items())


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _effective_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return effective_params(value)
    if isinstance(value, list | tuple):
        return [_effective_value(v) for v in value]
    return yaml_safe(value)


def yaml_safe(value: Any) -> Any:
    """Convert parameter values to what ``yaml.safe_dump`` accepts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: yaml_safe(v) for k, v in encode_params(value).items()}
    if isinstance(value, Mapping):
        return {str(k): yaml_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [yaml_safe(v) for v in value]
    if isinstance(value, enum.Enum):
        return yaml_safe(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _ref(ref: RefSpec) -> dict[str, Any]:
    return {"pluginRef": ref.plugin_ref}


def _band(band: PriorityBandSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if band.priority is not None:
        out["priority"] = band.priority
    if band.max_bytes is not None:
        out["maxBytes"] = band.max_bytes.text
    if band.max_requests is not None:
        out["maxRequests"] = band.max_requests.text
    if band.fairness_policy_ref is not None:
        out["fairnessPolicyRef"] = band.fairness_policy_ref
    if band.ordering_policy_ref is not None:
        out["orderingPolicyRef"] = band.ordering_policy_ref
    if band.default_request_ttl is not None:
        out["defaultRequestTTL"] = band.default_request_ttl.text
    return out


def _flow_control(fc: FlowControlSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if fc.max_bytes is not None:
        out["maxBytes"] = fc.max_bytes.text
    if fc.max_requests is not None:
        out["maxRequests"] = fc.max_requests.text
    if fc.default_request_ttl is not None:
        out["defaultRequestTTL"] = fc.default_request_ttl.text
    if fc.no_endpoint_request_ttl is not None:
        out["noEndpointRequestTTL"] = fc.no_endpoint_request_ttl.text
    if fc.default_priority_band is not None:
        out["defaultPriorityBand"] = _band(fc.default_priority_band)
    if fc.default_negative_priority_band is not None:
        out["defaultNegativePriorityBand"] = _band(fc.default_negative_priority_band)
    if fc.priority_bands:
        out["priorityBands"] = [_band(b) for b in fc.priority_bands]
    if fc.usage_limit_policy_plugin_ref is not None:
        out["usageLimitPolicyPluginRef"] = fc.usage_limit_policy_plugin_ref
    if fc.saturation_detector is not None:
        out["saturationDetector"] = _ref(fc.saturation_detector)
    if fc.enable_eviction is not None:
        out["enableEviction"] = fc.enable_eviction
    if fc.band_selection_policy_plugin_ref is not None:
        out["bandSelectionPolicyPluginRef"] = fc.band_selection_policy_plugin_ref
    return out


def _data_layer(dl: DataLayerSpec, v1: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "injectDefaults": dl.inject_defaults,
        "sources": [
            {"pluginRef": s.plugin_ref, "extractors": [_ref(e) for e in s.extractors]} for s in dl.sources
        ],
    }
    if v1:
        discovery: dict[str, Any] = {}
        if dl.discovery is not None:
            discovery["endpoints"] = _ref(dl.discovery)
        if dl.peer_discovery is not None:
            discovery["peers"] = _ref(dl.peer_discovery)
        if discovery:
            out["discovery"] = discovery
        cross: dict[str, Any] = {}
        if dl.cross_replica_syncer_plugin_ref is not None:
            cross["syncerPluginRef"] = dl.cross_replica_syncer_plugin_ref
        if dl.cross_replica_sync_interval is not None:
            cross["syncInterval"] = dl.cross_replica_sync_interval.text
        if dl.cross_replica_publish_timeout is not None:
            cross["publishTimeout"] = dl.cross_replica_publish_timeout.text
        if cross:
            out["crossReplica"] = cross
        return out
    if dl.discovery is not None:
        out["discovery"] = _ref(dl.discovery)
    if dl.peer_discovery is not None:
        out["peerDiscovery"] = _ref(dl.peer_discovery)
    if dl.cross_replica_syncer_plugin_ref is not None:
        out["crossReplicaSyncerPluginRef"] = dl.cross_replica_syncer_plugin_ref
    if dl.cross_replica_sync_interval is not None:
        out["crossReplicaSyncInterval"] = dl.cross_replica_sync_interval.text
    if dl.cross_replica_publish_timeout is not None:
        out["crossReplicaPublishTimeout"] = dl.cross_replica_publish_timeout.text
    return out


OUTPUT_VERSIONS = {"v1": API_VERSION, "v1alpha1": V1ALPHA1_API_VERSION}


def effective_document(
    doc: ConfigDocument, plugins: Mapping[str, Plugin], api_version: str = API_VERSION
) -> dict[str, Any]:
    """The effective configuration as a plain document (what ``render_effective`` dumps) in the
    layout of ``api_version`` (``llm-d.ai/v1`` or ``llm-d.ai/v1alpha1``)."""
    if api_version not in OUTPUT_VERSIONS.values():
        raise ValueError(f"cannot render apiVersion {api_version!r}")
    v1 = api_version == API_VERSION
    out: dict[str, Any] = {
        "apiVersion": api_version,
        "kind": doc.kind,
        "featureGates": list(doc.feature_gates),
    }
    entries = []
    for spec in doc.plugins:
        entry: dict[str, Any] = {"name": spec.name, "type": spec.type}
        params = effective_params(plugins[spec.name].params)
        if params:
            entry["parameters"] = params
        entries.append(entry)
    out["plugins"] = entries
    profiles = []
    for prof in doc.scheduling_profiles:
        refs = []
        for ref in prof.plugins:
            item: dict[str, Any] = {"pluginRef": ref.plugin_ref}
            if ref.weight is not None and isinstance(plugins[ref.plugin_ref], Scorer):
                item["weight"] = ref.weight
            refs.append(item)
        profiles.append({"name": prof.name, "plugins": refs})
    out["schedulingProfiles"] = profiles
    if doc.saturation_detector is not None and not v1:
        out["saturationDetector"] = _ref(doc.saturation_detector)
    out["dataLayer"] = _data_layer(doc.data_layer, v1)
    if doc.flow_control is not None:
        out["flowControl"] = _flow_control(doc.flow_control)
    if doc.parser is not None and not v1:
        out["parser"] = _ref(doc.parser)
    rh = doc.request_handler
    if rh is not None:
        handler: dict[str, Any] = {"parsers": [_ref(p) for p in rh.parsers]}
        if v1 or rh.propagate_priority:
            handler["propagatePriority"] = rh.propagate_priority
        out["requestHandler"] = handler
    return out


def render_effective(
    doc: ConfigDocument, plugins: Mapping[str, Plugin], api_version: str = API_VERSION
) -> str:
    """The effective configuration as YAML text; loading it again yields the same configuration."""
    return yaml.safe_dump(
        effective_document(doc, plugins, api_version),
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
    )
