"""Flow control: the ``flowControl`` section, its policy plugins and the saturation detector.

The default policy plugins are created whenever their types are registered. The saturation detector
(``flowControl.saturationDetector``, or the deprecated top-level ``saturationDetector``; the new
field wins) is always resolved: admission uses it with the gate off too. The rest of the section is
checked, and its defaults filled into the effective document, only with the ``flowControl`` gate
on; with the gate off those settings are ignored with a warning and left out of the effective
document.
"""

from __future__ import annotations

from epp.config import defaults as d
from epp.config.context import LoadContext
from epp.config.schema import Duration, FlowControlSpec, PriorityBandSpec, Quantity, RefSpec
from epp.framework import registry
from epp.framework.errors import ConfigError
from epp.framework.interfaces import (
    FairnessPolicy,
    OrderingPolicy,
    Plugin,
    SaturationDetector,
    UsageLimitPolicy,
)

_DEFAULT_TTL = Duration(d.DEFAULT_REQUEST_TTL, 60.0)
# epp dispatches bands highest priority first: the reference's default band selection policy.
STRICT_BAND_SELECTION = "strict-band-selection-policy"


def move_deprecated_saturation_detector(ctx: LoadContext) -> None:
    """Move a top-level ``saturationDetector`` under ``flowControl`` unless that one is set."""
    doc = ctx.doc
    old = doc.saturation_detector
    if old is None:
        return
    ctx.warnings.append(
        "saturationDetector: the top-level saturationDetector is deprecated, use "
        "flowControl.saturationDetector instead (if both are set, flowControl.saturationDetector is used)"
    )
    if doc.flow_control is None:
        doc.flow_control = FlowControlSpec()
    if doc.flow_control.saturation_detector is None:
        doc.flow_control.saturation_detector = old
    doc.saturation_detector = None


def apply_flow_control_defaults(ctx: LoadContext) -> None:
    """Create the default policy plugins; always, even with flow control off (as in the reference)."""
    for type_name in d.FLOW_CONTROL_DEFAULTS:
        if type_name not in ctx.plugins and registry.lookup(type_name) is not None:
            ctx.add_default(type_name, "flow control")


def resolve_saturation_detector(ctx: LoadContext) -> SaturationDetector | None:
    """The saturation detector; ``utilization-detector`` when none (or an empty ref) is named.

    A ``utilization-detector`` declared under ``plugins`` is used with its parameters, otherwise one
    is created with the defaults; any other name must be declared. It is not added to any profile,
    so it is not a filter.
    """
    fc = ctx.doc.flow_control
    if fc is None:
        fc = ctx.doc.flow_control = FlowControlSpec()
    ref = fc.saturation_detector
    if ref is None:
        ref = fc.saturation_detector = RefSpec("", "flowControl.saturationDetector")
    if not ref.plugin_ref:
        ref.plugin_ref = d.DEFAULT_SATURATION_DETECTOR
    where = f"{ref.path}.pluginRef"
    plugin = ctx.get(ref.plugin_ref)
    if plugin is None and ref.plugin_ref == d.DEFAULT_SATURATION_DETECTOR:
        if registry.lookup(ref.plugin_ref) is None:
            fc.saturation_detector = None
            return None  # not in this build: no saturation detector, no legacy shedding
        plugin = ctx.add_default(d.DEFAULT_SATURATION_DETECTOR, "saturation detector")
    if plugin is None:
        raise ConfigError(
            where,
            f"saturation detector references undefined plugin '{ref.plugin_ref}'"
            f"{ctx.did_you_mean(ref.plugin_ref)}",
        )
    if not isinstance(plugin, SaturationDetector):
        raise ConfigError(
            where, f"plugin '{ref.plugin_ref}' is not a fwkfc.SaturationDetector (type {plugin.type_name})"
        )
    return plugin


def ignore_flow_control(ctx: LoadContext) -> None:
    """Gate off: warn about settings that are ignored and keep only the saturation detector."""
    fc = ctx.doc.flow_control
    if fc is None or not fc.has_settings():
        return
    ctx.warnings.append(
        "flowControl: the flowControl config section is set but the flowControl feature gate is "
        "disabled; its settings (other than saturationDetector) are ignored"
    )
    ctx.doc.flow_control = FlowControlSpec(saturation_detector=fc.saturation_detector)


def check_flow_control(ctx: LoadContext) -> None:
    """Gate on: validate ``flowControl`` and fill its defaults into the effective document."""
    fc = ctx.doc.flow_control
    if fc is None:
        fc = ctx.doc.flow_control = FlowControlSpec()
    fc.max_bytes = _global_limit(fc.max_bytes, "flowControl.maxBytes", "maxBytes")
    fc.max_requests = _global_limit(fc.max_requests, "flowControl.maxRequests", "maxRequests")
    fc.default_request_ttl = _ttl(
        fc.default_request_ttl, _DEFAULT_TTL, "defaultRequestTTL", "DefaultRequestTTL"
    )
    # Left unset, the no-endpoint budget follows defaultRequestTTL.
    fc.no_endpoint_request_ttl = _ttl(
        fc.no_endpoint_request_ttl, fc.default_request_ttl, "noEndpointRequestTTL", "NoEndpointRequestTTL"
    )
    if fc.default_priority_band is None:
        fc.default_priority_band = PriorityBandSpec(path="flowControl.defaultPriorityBand")
    _check_band(ctx, fc.default_priority_band)
    if fc.default_negative_priority_band is not None:
        _check_band(ctx, fc.default_negative_priority_band)
    seen: set[int] = set()
    for band in fc.priority_bands:
        if band.priority is None:
            band.priority = 0
        if band.priority in seen:
            raise ConfigError(f"{band.path}.priority", f"duplicate priority level {band.priority}")
        seen.add(band.priority)
        _check_band(ctx, band)
    ref = fc.usage_limit_policy_plugin_ref
    where = "flowControl.usageLimitPolicyPluginRef"
    if not ref:
        fc.usage_limit_policy_plugin_ref = (
            d.DEFAULT_USAGE_LIMIT_POLICY if d.DEFAULT_USAGE_LIMIT_POLICY in ctx.plugins else None
        )
    else:
        plugin = ctx.get(ref)
        if plugin is None:
            raise ConfigError(where, f"usage limit policy plugin '{ref}' not found{ctx.did_you_mean(ref)}")
        _check_kind(plugin, UsageLimitPolicy, "a usage limit policy", where)
    if fc.enable_eviction is None:
        fc.enable_eviction = False
    _check_band_selection(ctx, fc.band_selection_policy_plugin_ref)


def _check_band_selection(ctx: LoadContext, ref: str | None) -> None:
    """``bandSelectionPolicyPluginRef``: only strict priority order, epp's dispatch order, exists."""
    if not ref or ref == STRICT_BAND_SELECTION:
        return
    where = "flowControl.bandSelectionPolicyPluginRef"
    plugin = ctx.get(ref)
    if plugin is not None and plugin.type_name == STRICT_BAND_SELECTION:
        return
    raise ConfigError(
        where,
        f"band selection policy '{ref}' is not available: epp offers bands dispatch in strict "
        f"priority order only ('{STRICT_BAND_SELECTION}', the default)",
    )


def _global_limit(q: Quantity | None, where: str, name: str) -> Quantity:
    """A global cap: omitted or ``0`` means unlimited (recorded as ``"0"``)."""
    _non_negative(q, where, name)
    return Quantity("0", 0) if q is None else q


def _ttl(value: Duration | None, default: Duration, key: str, name: str) -> Duration:
    if value is None:
        return default
    if value.seconds < 0:
        raise ConfigError(f"flowControl.{key}", f"{name} cannot be negative, but got {value.text}")
    return value


def _check_band(ctx: LoadContext, band: PriorityBandSpec) -> None:
    """Per-band caps (omitted or ``0``: the system default) and policy references."""
    _non_negative(band.max_bytes, f"{band.path}.maxBytes", "maxBytes")
    _non_negative(band.max_requests, f"{band.path}.maxRequests", "maxRequests")
    ttl = band.default_request_ttl
    if ttl is not None and ttl.seconds < 0:
        raise ConfigError(
            f"{band.path}.defaultRequestTTL", f"DefaultRequestTTL cannot be negative, but got {ttl.text}"
        )
    if band.max_bytes is None or band.max_bytes.value == 0:
        band.max_bytes = Quantity(str(d.DEFAULT_BAND_MAX_BYTES), d.DEFAULT_BAND_MAX_BYTES)
    if band.max_requests is None or band.max_requests.value == 0:
        band.max_requests = Quantity(str(d.DEFAULT_BAND_MAX_REQUESTS), d.DEFAULT_BAND_MAX_REQUESTS)
    band.fairness_policy_ref = _policy_ref(
        ctx, band.fairness_policy_ref, d.DEFAULT_FAIRNESS_POLICY, f"{band.path}.fairnessPolicyRef", "fairness"
    )
    band.ordering_policy_ref = _policy_ref(
        ctx, band.ordering_policy_ref, d.DEFAULT_ORDERING_POLICY, f"{band.path}.orderingPolicyRef", "ordering"
    )


_POLICY_KINDS: dict[str, tuple[type[Plugin], str]] = {
    "fairness": (FairnessPolicy, "a fairness policy"),
    "ordering": (OrderingPolicy, "an ordering policy"),
}


def _policy_ref(ctx: LoadContext, ref: str | None, default: str, where: str, kind: str) -> str | None:
    """The policy a band uses: ``ref`` (a declared policy of that kind) or the default when it exists."""
    if not ref:
        return default if default in ctx.plugins else None
    plugin = ctx.get(ref)
    if plugin is None:
        raise ConfigError(where, f'no {kind} policy registered for name "{ref}"{ctx.did_you_mean(ref)}')
    _check_kind(plugin, *_POLICY_KINDS[kind], where)
    return ref


def _check_kind(plugin: Plugin, kind: type[Plugin], what: str, where: str) -> None:
    if not isinstance(plugin, kind):
        raise ConfigError(where, f"plugin '{plugin.name}' (type {plugin.type_name}) is not {what}")


def _non_negative(q: Quantity | None, where: str, name: str) -> None:
    if q is not None and q.value < 0:
        raise ConfigError(where, f"{name} must be non-negative, got {q.text}")
