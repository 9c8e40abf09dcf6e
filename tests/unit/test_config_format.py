"""Tests of the v0.10 ``EndpointPickerConfig`` format: ``flowControl``, ``featureGates``, ``dataLayer``,
dependency-ordered plugin creation, plugin stability and deprecated type names.

Test-local plugin types are registered inside a registry sandbox for one test each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import yaml

from epp.config import ConfigError, LoadedConfig, load_config
from epp.framework import (
    FairnessPolicy,
    Filter,
    OrderingPolicy,
    Plugin,
    Stability,
    UsageLimitPolicy,
    registry,
)
from epp.plugins.saturation.utilization_detector import UtilizationDetector
from tests.unit.factories import NO_ENV
from tests.unit.factories import config as load
from tests.unit.factories import config_error as load_error


def effective(cfg: LoadedConfig) -> dict[str, Any]:
    doc = yaml.safe_load(cfg.effective_yaml())
    assert isinstance(doc, dict)
    return doc


# --- stub plugins ------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class RefsParams:
    dependency: str = ""
    nested: dict[str, str] | None = None


class StubWithDeps(Plugin):
    """Looks up ``dependency`` (and ``nested.dependency``) through the handle while being created."""

    type_name = "test-with-dependencies"
    Params = RefsParams
    created: ClassVar[list[str]] = []

    def __init__(self, name: str, params: RefsParams, handle: Any = None) -> None:
        super().__init__(name, params, handle)
        refs = [params.dependency, (params.nested or {}).get("dependency", "")]
        self.deps = [handle.plugin(r) for r in refs if r]
        if any(d is None for d in self.deps):
            raise ConfigError("dependency", "plugin not found")
        StubWithDeps.created.append(name)


class StubLeaf(Plugin):
    type_name = "test-leaf"

    def __init__(self, name: str, params: Any, handle: Any = None) -> None:
        super().__init__(name, params, handle)
        StubWithDeps.created.append(name)


class StubAlpha(Filter):
    type_name = "test-alpha-filter"
    stability = Stability.ALPHA

    def filter(self, cycle: Any, request: Any, endpoints: list[Any]) -> list[Any]:
        return endpoints


class StubOrdering(OrderingPolicy):
    type_name = "test-ordering-policy"

    def sort_key(self, item: Any) -> tuple[float, ...]:
        return (item.seq,)


class StubFairness(FairnessPolicy):
    type_name = "test-fairness-policy"

    def pick(self, band: Any) -> Any:
        return next(band.flows(), None)


class StubUsageLimit(UsageLimitPolicy):
    type_name = "test-usage-limit-policy"

    def compute_limit(self, saturation: float, priorities: Any, ceilings: list[float]) -> None:
        return None


class StubAny(Plugin):
    type_name = "test-any"


STUBS = (StubWithDeps, StubLeaf, StubAlpha, StubOrdering, StubFairness, StubUsageLimit, StubAny)


@pytest.fixture(autouse=True)
def sandbox() -> Iterator[None]:
    registry.registered_types()  # import the built-ins before taking the snapshot
    saved = (dict(registry._REGISTRY), dict(registry._ALIASES), dict(registry._DEPRECATED))
    saved_warned = set(registry._WARNED)
    registry._WARNED.clear()  # every test sees deprecation warnings afresh
    for cls in STUBS:
        registry.register(cls)
    StubWithDeps.created.clear()
    try:
        yield
    finally:
        for current, old in zip(
            (registry._REGISTRY, registry._ALIASES, registry._DEPRECATED), saved, strict=True
        ):
            current.clear()
            current.update(old)  # type: ignore[attr-defined]
        registry._WARNED.clear()
        registry._WARNED.update(saved_warned)


# --- flowControl -------------------------------------------------------------------------------------

FULL_FLOW_CONTROL = """
featureGates: [flowControl]
plugins:
- {name: ord, type: test-ordering-policy}
- {name: fair, type: test-fairness-policy}
- {name: holdback, type: test-usage-limit-policy}
- {name: gate, type: utilization-detector, parameters: {queueDepthThreshold: 7}}
flowControl:
  maxBytes: 2Gi
  maxRequests: 300
  defaultRequestTTL: 30s
  noEndpointRequestTTL: 10m
  defaultPriorityBand: {maxRequests: 100, fairnessPolicyRef: fair}
  defaultNegativePriorityBand: {maxRequests: 50}
  priorityBands:
  - {priority: 10, maxRequests: 2k, maxBytes: "0", fairnessPolicyRef: fair, orderingPolicyRef: ord}
  - {maxBytes: 1M}
  usageLimitPolicyPluginRef: holdback
  saturationDetector: {pluginRef: gate}
  enableEviction: true
"""


def test_every_flow_control_field_is_accepted_and_recorded_in_the_effective_config() -> None:
    cfg = load(FULL_FLOW_CONTROL)
    fc = effective(cfg)["flowControl"]
    assert fc == {
        "maxBytes": "2Gi",
        "maxRequests": "300",
        "defaultRequestTTL": "30s",
        "noEndpointRequestTTL": "10m",
        "defaultPriorityBand": {
            "maxBytes": "1000000000",
            "maxRequests": "100",
            "fairnessPolicyRef": "fair",
            "orderingPolicyRef": "fcfs-ordering-policy",  # the built-in default, created
        },
        "defaultNegativePriorityBand": {
            "maxBytes": "1000000000",
            "maxRequests": "50",
            "fairnessPolicyRef": "global-strict-fairness-policy",
            "orderingPolicyRef": "fcfs-ordering-policy",
        },
        "priorityBands": [
            {
                "priority": 10,
                "maxBytes": "1000000000",  # "0" means the system default
                "maxRequests": "2k",
                "fairnessPolicyRef": "fair",
                "orderingPolicyRef": "ord",
            },
            {
                "priority": 0,
                "maxBytes": "1M",
                "maxRequests": "5000",
                "fairnessPolicyRef": "global-strict-fairness-policy",
                "orderingPolicyRef": "fcfs-ordering-policy",
            },
        ],
        "usageLimitPolicyPluginRef": "holdback",
        "saturationDetector": {"pluginRef": "gate"},
        "enableEviction": True,
    }
    band = cfg.document.flow_control.priority_bands[0]  # type: ignore[union-attr]
    assert band.max_requests is not None and band.max_requests.value == 2000
    assert cfg.saturation_detector is cfg.plugins["gate"]
    again = load_config(cfg.effective_yaml(), environ=NO_ENV)
    assert again.effective_yaml() == cfg.effective_yaml()


def test_flow_control_defaults_are_filled_with_the_gate_on() -> None:
    fc = effective(load("featureGates: [flowControl]\n"))["flowControl"]
    assert fc == {
        "maxBytes": "0",
        "maxRequests": "0",
        "defaultRequestTTL": "60s",
        "noEndpointRequestTTL": "60s",
        "defaultPriorityBand": {
            "maxBytes": "1000000000",
            "maxRequests": "5000",
            "fairnessPolicyRef": "global-strict-fairness-policy",
            "orderingPolicyRef": "fcfs-ordering-policy",
        },
        "usageLimitPolicyPluginRef": "static-usage-limit-policy",
        "saturationDetector": {"pluginRef": "utilization-detector"},
        "enableEviction": False,
    }


@pytest.mark.parametrize(("ttl", "expected"), [("0s", "0s"), ("2m", "2m")])
def test_no_endpoint_ttl_follows_the_default_ttl(ttl: str, expected: str) -> None:
    fc = effective(load(f"featureGates: [flowControl]\nflowControl: {{defaultRequestTTL: {ttl}}}\n"))
    assert fc["flowControl"]["noEndpointRequestTTL"] == expected


@pytest.mark.parametrize(
    ("body", "field_path", "reason"),
    [
        (
            "flowControl: {noEndpointRequestTTL: -1s}\n",
            "flowControl.noEndpointRequestTTL",
            "NoEndpointRequestTTL cannot be negative, but got -1s",
        ),
        (
            "flowControl: {noEndpointRequestTTL: 5}\n",
            "flowControl.noEndpointRequestTTL",
            "expected a duration",
        ),
        (
            "flowControl:\n  defaultNegativePriorityBand: {maxRequests: '-2'}\n",
            "flowControl.defaultNegativePriorityBand.maxRequests",
            "maxRequests must be non-negative, got -2",
        ),
        (
            "flowControl:\n  defaultNegativePriorityBand: {maxRequest: 2}\n",
            "flowControl.defaultNegativePriorityBand.maxRequest",
            'did you mean "maxRequests"?',
        ),
        (
            "plugins: [{type: queue-scorer}]\nflowControl:\n"
            "  priorityBands: [{priority: 1, orderingPolicyRef: queue-scorer}]\n",
            "flowControl.priorityBands[0].orderingPolicyRef",
            "plugin 'queue-scorer' (type queue-scorer) is not an ordering policy",
        ),
        (
            "plugins: [{name: o, type: test-ordering-policy}]\nflowControl:\n"
            "  defaultPriorityBand: {fairnessPolicyRef: o}\n",
            "flowControl.defaultPriorityBand.fairnessPolicyRef",
            "is not a fairness policy",
        ),
        (
            "plugins: [{name: o, type: test-ordering-policy}]\nflowControl: {usageLimitPolicyPluginRef: o}\n",
            "flowControl.usageLimitPolicyPluginRef",
            "is not a usage limit policy",
        ),
        (
            "plugins: [{name: holdback, type: test-usage-limit-policy}]\n"
            "flowControl: {usageLimitPolicyPluginRef: holdbak}\n",
            "flowControl.usageLimitPolicyPluginRef",
            "usage limit policy plugin 'holdbak' not found; did you mean 'holdback'?",
        ),
        (
            "flowControl:\n  saturationDetector: {pluginRef: nope}\n",
            "flowControl.saturationDetector.pluginRef",
            "saturation detector references undefined plugin 'nope'",
        ),
        (
            "plugins: [{type: queue-scorer}]\n"
            "flowControl:\n  saturationDetector: {pluginRef: queue-scorer}\n",
            "flowControl.saturationDetector.pluginRef",
            "is not a fwkfc.SaturationDetector",
        ),
        (
            "flowControl:\n  saturationDetector: {pluginRef: x, extra: 1}\n",
            "flowControl.saturationDetector.extra",
            'unknown field "extra"',
        ),
    ],
)
def test_flow_control_errors_name_the_field(body: str, field_path: str, reason: str) -> None:
    err = load_error("featureGates: [flowControl]\n" + body)
    assert err.field == field_path
    assert reason in err.reason


def test_flow_control_saturation_detector_selects_the_detector_with_the_gate_off() -> None:
    cfg = load(
        "plugins:\n- {name: gate, type: utilization-detector, parameters: {queueDepthThreshold: 3}}\n"
        "flowControl:\n  saturationDetector: {pluginRef: gate}\n"
    )
    assert isinstance(cfg.saturation_detector, UtilizationDetector)
    assert cfg.saturation_detector is cfg.plugins["gate"]
    assert "utilization-detector" not in cfg.plugins
    assert not any("flowControl" in w for w in cfg.warnings)  # the detector alone is not ignored


def test_new_saturation_detector_field_wins_over_the_deprecated_one() -> None:
    cfg = load(
        "plugins:\n- {name: old, type: utilization-detector}\n- {name: new, type: utilization-detector}\n"
        "saturationDetector: {pluginRef: old}\n"
        "flowControl:\n  saturationDetector: {pluginRef: new}\n"
    )
    assert cfg.saturation_detector is cfg.plugins["new"]
    assert any("top-level saturationDetector is deprecated" in w for w in cfg.warnings)
    doc = effective(cfg)
    assert "saturationDetector" not in doc
    assert doc["flowControl"]["saturationDetector"] == {"pluginRef": "new"}


def test_deprecated_saturation_detector_alone_still_selects_the_detector() -> None:
    cfg = load("plugins:\n- {name: old, type: utilization-detector}\nsaturationDetector: {pluginRef: old}\n")
    assert cfg.saturation_detector is cfg.plugins["old"]
    assert effective(cfg)["flowControl"] == {"saturationDetector": {"pluginRef": "old"}}


@pytest.mark.parametrize("ref", ["{}", "{pluginRef: ''}"])
def test_an_empty_saturation_detector_ref_means_the_default(ref: str) -> None:
    cfg = load(f"flowControl:\n  saturationDetector: {ref}\n")
    assert cfg.saturation_detector is cfg.plugins["utilization-detector"]


def test_flow_control_settings_are_ignored_with_a_warning_when_the_gate_is_off() -> None:
    cfg = load(
        "featureGates: [flowControl=false]\n"
        "flowControl: {maxBytes: '-1', defaultRequestTTL: -5s,\n"
        "              priorityBands: [{priority: 1}, {priority: 1}]}\n"
    )
    assert not cfg.flow_control_enabled
    (warning,) = [w for w in cfg.warnings if w.startswith("flowControl:")]
    assert "feature gate is disabled" in warning and "ignored" in warning
    assert effective(cfg)["flowControl"] == {"saturationDetector": {"pluginRef": "utilization-detector"}}


def test_no_flow_control_warning_without_settings() -> None:
    assert not [w for w in load("featureGates: [flowControl=false]\n").warnings if "flowControl" in w]


# --- featureGates ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gates", "enabled", "rendered"),
    [
        (
            "[flowControl]",
            {"flowControl", "haPopulateNonLeaderDatastore"},
            ["flowControl", "haPopulateNonLeaderDatastore"],
        ),
        (
            "[flowControl=true]",
            {"flowControl", "haPopulateNonLeaderDatastore"},
            ["flowControl", "haPopulateNonLeaderDatastore"],
        ),
        (
            "['flowControl=TRUE']",
            {"flowControl", "haPopulateNonLeaderDatastore"},
            ["flowControl", "haPopulateNonLeaderDatastore"],
        ),
        ("[flowControl=false]", {"haPopulateNonLeaderDatastore"}, ["haPopulateNonLeaderDatastore"]),
        ("[flowControl, flowControl=f]", {"haPopulateNonLeaderDatastore"}, ["haPopulateNonLeaderDatastore"]),
        ("[haPopulateNonLeaderDatastore=false]", set(), ["haPopulateNonLeaderDatastore=false"]),
        ("[]", {"haPopulateNonLeaderDatastore"}, ["haPopulateNonLeaderDatastore"]),
    ],
)
def test_feature_gate_values(gates: str, enabled: set[str], rendered: list[str]) -> None:
    cfg = load(f"featureGates: {gates}\n")
    assert cfg.feature_gates == frozenset(enabled)
    assert effective(cfg)["featureGates"] == rendered
    assert load_config(cfg.effective_yaml(), environ=NO_ENV).feature_gates == cfg.feature_gates


def test_turning_off_the_ha_gate_warns_that_it_has_no_effect() -> None:
    cfg = load("featureGates: [haPopulateNonLeaderDatastore=false]\n")
    assert any("haPopulateNonLeaderDatastore=false" in w and "no effect" in w for w in cfg.warnings)


@pytest.mark.parametrize(
    ("gates", "field_path", "reason"),
    [
        ("[unknown-gate]", "featureGates[0]", "feature gate 'unknown-gate' is unknown or unregistered"),
        ("[flowControl, flowcontrol]", "featureGates[1]", 'did you mean "flowControl"?'),
        ("[unknown-gate=false]", "featureGates[0]", "feature gate 'unknown-gate' is unknown"),
        (
            "[flowControl=qwerty]",
            "featureGates[0]",
            "qwerty is not a valid value for the feature gate flowControl",
        ),
        ("[flowControl=]", "featureGates[0]", "is not a valid value for the feature gate flowControl"),
        ("[1]", "featureGates[0]", "expected a string"),
    ],
)
def test_bad_feature_gates_are_rejected(gates: str, field_path: str, reason: str) -> None:
    err = load_error(f"featureGates: {gates}\n")
    assert err.field == field_path
    assert reason in err.reason


# --- dataLayer ---------------------------------------------------------------------------------------


def test_inject_defaults_false_without_sources_is_valid_and_collects_nothing() -> None:
    cfg = load("dataLayer: {injectDefaults: false}\n")
    assert cfg.data_sources == []
    assert "metrics-data-source" not in cfg.plugins
    assert effective(cfg)["dataLayer"] == {"injectDefaults": False, "sources": []}


def test_default_metrics_source_is_added_to_other_sources() -> None:
    cfg = load("plugins: [{name: m2, type: metrics-data-source}]\ndataLayer:\n  sources: [{pluginRef: m2}]\n")
    assert [s.name for s, _ in cfg.data_sources] == ["m2"]  # a renamed metrics source counts
    models = load("dataLayer: {}\n")
    assert [s.name for s, _ in models.data_sources] == ["metrics-data-source"]
    assert [e.name for e in models.data_sources[0][1]] == ["core-metrics-extractor"]


def test_cross_replica_syncer_is_wired_and_peer_discovery_names_it() -> None:
    cfg = load(
        "plugins: [{name: sync, type: redis-syncer}]\n"
        "dataLayer:\n  peerDiscovery: {pluginRef: sync}\n  crossReplicaSyncerPluginRef: sync\n"
        "  crossReplicaSyncInterval: 500ms\n  crossReplicaPublishTimeout: 2s\n"
    )
    dl = effective(cfg)["dataLayer"]  # in the v1 layout
    assert dl["discovery"]["peers"] == {"pluginRef": "sync"}
    assert dl["crossReplica"] == {"syncerPluginRef": "sync", "syncInterval": "500ms", "publishTimeout": "2s"}
    old = yaml.safe_load(cfg.effective_yaml("llm-d.ai/v1alpha1"))["dataLayer"]
    assert old["peerDiscovery"] == {"pluginRef": "sync"}
    assert old["crossReplicaSyncerPluginRef"] == "sync"
    assert old["crossReplicaSyncInterval"] == "500ms"
    assert old["crossReplicaPublishTimeout"] == "2s"
    assert cfg.cross_replica is not None
    assert cfg.cross_replica.syncer is cfg.plugins["sync"]
    assert (cfg.cross_replica.interval, cfg.cross_replica.publish_timeout) == (0.5, 2.0)
    assert not [w for w in cfg.warnings if "peerDiscovery" in w]
    assert load_config(cfg.effective_yaml(), environ=NO_ENV).effective_yaml() == cfg.effective_yaml()


def test_peer_discovery_other_than_the_syncer_warns_and_a_non_syncer_is_rejected() -> None:
    cfg = load("plugins: [{name: peers, type: test-any}]\ndataLayer:\n  peerDiscovery: {pluginRef: peers}\n")
    (warning,) = [w for w in cfg.warnings if "peerDiscovery" in w]
    assert "no effect" in warning and cfg.cross_replica is None
    err = load_error(
        "plugins: [{name: sync, type: test-any}]\ndataLayer: {crossReplicaSyncerPluginRef: sync}\n"
    )
    assert err.field == "dataLayer.crossReplicaSyncerPluginRef"
    assert "not a CrossReplicaSyncer" in err.reason


@pytest.mark.parametrize(
    ("body", "field_path", "reason"),
    [
        (
            "dataLayer:\n  peerDiscovery: {pluginRef: ghost}\n",
            "dataLayer.peerDiscovery.pluginRef",
            "undefined plugin 'ghost'",
        ),
        (
            "dataLayer:\n  peerDiscovery: {}\n",
            "dataLayer.peerDiscovery.pluginRef",
            "plugin reference is empty",
        ),
        ("dataLayer:\n  peerDiscovery: {ref: x}\n", "dataLayer.peerDiscovery.ref", 'unknown field "ref"'),
        (
            "dataLayer: {crossReplicaSyncerPluginRef: ghost}\n",
            "dataLayer.crossReplicaSyncerPluginRef",
            "undefined plugin",
        ),
        (
            "dataLayer: {crossReplicaSyncInterval: soon}\n",
            "dataLayer.crossReplicaSyncInterval",
            "invalid duration",
        ),
        (
            "dataLayer: {crossReplicaSyncInterval: -1s}\n",
            "dataLayer.crossReplicaSyncInterval",
            "cannot be negative",
        ),
        (
            "dataLayer: {crossReplicaPublishTimeout: -1s}\n",
            "dataLayer.crossReplicaPublishTimeout",
            "cannot be negative",
        ),
        ("dataLayer: {injectDefault: false}\n", "dataLayer.injectDefault", 'did you mean "injectDefaults"?'),
    ],
)
def test_data_layer_errors_name_the_field(body: str, field_path: str, reason: str) -> None:
    err = load_error(body)
    assert err.field == field_path
    assert reason in err.reason


# --- dependency order --------------------------------------------------------------------------------


def test_a_plugin_is_created_after_the_plugins_it_references_whatever_the_order() -> None:
    cfg = load(
        """
plugins:
- {name: top, type: test-with-dependencies, parameters: {dependency: mid, nested: {dependency: leaf2}}}
- {name: mid, type: test-with-dependencies, parameters: {dependency: leaf}}
- {name: leaf, type: test-leaf}
- {name: leaf2, type: test-leaf}
"""
    )
    assert StubWithDeps.created == ["leaf", "mid", "leaf2", "top"]
    top = cfg.plugins["top"]
    assert isinstance(top, StubWithDeps)
    assert top.deps == [cfg.plugins["mid"], cfg.plugins["leaf2"]]
    assert list(cfg.plugins)[:4] == ["top", "mid", "leaf", "leaf2"]  # declaration order kept


@pytest.mark.parametrize(
    ("plugins", "loop"),
    [
        (
            "- {name: a, type: test-with-dependencies, parameters: {dependency: b}}\n"
            "- {name: b, type: test-with-dependencies, parameters: {dependency: c}}\n"
            "- {name: c, type: test-with-dependencies, parameters: {nested: {dependency: a}}}\n",
            "a -> b -> c -> a",
        ),
        (
            "- {name: test1, type: test-with-dependencies, parameters: {dependency: test1}}\n",
            "test1 -> test1",
        ),
    ],
)
def test_a_reference_cycle_is_an_error_naming_the_loop(plugins: str, loop: str) -> None:
    err = load_error("plugins:\n" + plugins)
    assert err.field == "plugins[0]"
    assert err.reason == f"plugins reference each other in a loop: {loop}"


def test_an_error_in_a_dependency_names_the_dependency() -> None:
    err = load_error(
        "plugins:\n- {name: a, type: test-with-dependencies, parameters: {dependency: b}}\n"
        "- {name: b, type: max-score-picker, parameters: {maxNumOfEndpoints: x}}\n"
    )
    assert err.field == "plugins[1].parameters.maxNumOfEndpoints"
    assert err.reason.startswith("expected an integer")


# --- stability and deprecated names ------------------------------------------------------------------


def test_alpha_types_need_allow_experimental() -> None:
    body = "plugins: [{name: f, type: test-alpha-filter}]\n"
    err = load_error(body, allow_experimental=False)
    assert err.field == "plugins[0].type"
    assert "plugin 'f' (type: 'test-alpha-filter') has Alpha stability level" in err.reason
    assert "--allow-experimental-plugins" in err.reason
    cfg = load(body, allow_experimental=True)
    assert [f.name for f in cfg.scheduler.profiles["default"].filters] == ["f"]


PD_LEGACY = (
    "plugins:\n- {type: pd-profile-handler}\n- {type: prefix-based-pd-decider}\n"
    "schedulingProfiles: [{name: decode}, {name: prefill}]\n"
)


@pytest.mark.parametrize(
    ("type_name", "replacement", "body"),
    [
        (
            "by-label",
            "label-selector-filter",
            "plugins:\n- {name: one, type: by-label, parameters: {label: r, validValues: [d]}}\n"
            "- {name: two, type: by-label, parameters: {label: r, validValues: [p]}}\n",
        ),
        (
            "by-label-selector",
            "label-selector-filter",
            "plugins:\n- {name: one, type: by-label-selector, parameters: {matchLabels: {r: d}}}\n"
            "- {name: two, type: by-label-selector}\n",
        ),
        ("pd-profile-handler", "disagg-profile-handler", PD_LEGACY),
        ("disagg-headers-handler", "disagg-profile-handler", "plugins: [{type: disagg-headers-handler}]\n"),
        ("prefill-header-handler", "disagg-profile-handler", "plugins: [{type: prefill-header-handler}]\n"),
    ],
)
def test_deprecated_type_names_warn_once_naming_the_replacement(
    type_name: str, replacement: str, body: str
) -> None:
    cfg = load(body)
    warnings = [w for w in cfg.warnings if f"'{type_name}' is deprecated" in w]
    assert len(warnings) == 1, cfg.warnings  # one warning, however many instances
    assert warnings[0].startswith("plugins[0].type: ")
    assert f"use '{replacement}' instead" in warnings[0]
    assert not [w for w in load(body).warnings if f"'{type_name}' is deprecated" in w]  # once per process


def test_unknown_type_suggests_the_closest_registered_type() -> None:
    err = load_error("plugins: [{type: prefix-cache-scorr}]\n")
    assert err.field == "plugins[0].type"
    assert (
        err.reason
        == "plugin type 'prefix-cache-scorr' is not registered; did you mean 'prefix-cache-scorer'?"
    )
    far = load_error("plugins: [{type: zzzzzz}]\n")
    assert "did you mean" not in far.reason and "epp plugins" in far.reason


def test_unknown_parameter_suggests_the_closest_parameter() -> None:
    err = load_error("plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoint: 2}}]\n")
    assert err.field == "plugins[0].parameters.maxNumOfEndpoint"
    assert 'did you mean "maxNumOfEndpoints"?' in err.reason
    assert "(known: maxNumOfEndpoints)" in err.reason
