"""Rendering the effective configuration as YAML (``epp check-config``): every default filled in."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import yaml

from epp.config.schema import ConfigDocument, DataLayerSpec, FlowControlSpec, PriorityBandSpec, RefSpec
from epp.framework.interfaces import Plugin, Scorer
from epp.framework.params import encode_params


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
    return out


def _data_layer(dl: DataLayerSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "injectDefaults": dl.inject_defaults,
        "sources": [
            {"pluginRef": s.plugin_ref, "extractors": [_ref(e) for e in s.extractors]} for s in dl.sources
        ],
    }
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


def effective_document(doc: ConfigDocument, plugins: Mapping[str, Plugin]) -> dict[str, Any]:
    """The effective configuration as a plain document (what ``render_effective`` dumps)."""
    out: dict[str, Any] = {
        "apiVersion": doc.api_version,
        "kind": doc.kind,
        "featureGates": list(doc.feature_gates),
    }
    entries = []
    for spec in doc.plugins:
        entry: dict[str, Any] = {"name": spec.name, "type": spec.type}
        params = yaml_safe(encode_params(plugins[spec.name].params))
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
    if doc.saturation_detector is not None:
        out["saturationDetector"] = _ref(doc.saturation_detector)
    out["dataLayer"] = _data_layer(doc.data_layer)
    if doc.flow_control is not None:
        out["flowControl"] = _flow_control(doc.flow_control)
    if doc.parser is not None:
        out["parser"] = _ref(doc.parser)
    if doc.request_handler is not None:
        out["requestHandler"] = {"parsers": [_ref(p) for p in doc.request_handler.parsers]}
    return out


def render_effective(doc: ConfigDocument, plugins: Mapping[str, Plugin]) -> str:
    """The effective configuration as YAML text; loading it again yields the same configuration."""
    return yaml.safe_dump(
        effective_document(doc, plugins), sort_keys=False, default_flow_style=False, allow_unicode=True
    )
