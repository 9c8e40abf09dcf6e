"""Flow control: its policy plugins (always created when registered) and the ``flowControl`` checks.

The checks run, and the defaults are filled into the effective document, only with the gate on.
"""

from __future__ import annotations

from epp.config import defaults as d
from epp.config.context import LoadContext
from epp.config.schema import FlowControlSpec, PriorityBandSpec, Quantity
from epp.framework import registry
from epp.framework.errors import ConfigError


def apply_flow_control_defaults(ctx: LoadContext) -> None:
    """Create the default policy plugins; always, even with flow control off (as in the reference)."""
    for type_name in d.FLOW_CONTROL_DEFAULTS:
        if type_name not in ctx.plugins and registry.lookup(type_name) is not None:
            ctx.add_default(type_name, "flow control")


def check_flow_control(ctx: LoadContext) -> None:
    """Validate ``flowControl`` (gate on) and fill its defaults into the effective document.

    Policy kinds are not checked: the framework has no flow-control interfaces yet.
    """
    fc = ctx.doc.flow_control
    if fc is None:
        fc = ctx.doc.flow_control = FlowControlSpec()
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
        _check_band(ctx, band)
    if fc.default_priority_band is not None:
        _check_band(ctx, fc.default_priority_band)
    ref = fc.usage_limit_policy_plugin_ref
    if ref is None:
        if d.DEFAULT_USAGE_LIMIT_POLICY in ctx.plugins:
            fc.usage_limit_policy_plugin_ref = d.DEFAULT_USAGE_LIMIT_POLICY
    elif ref not in ctx.plugins:
        raise ConfigError(
            "flowControl.usageLimitPolicyPluginRef", f"usage limit policy plugin '{ref}' not found"
        )
    if fc.enable_eviction is None:
        fc.enable_eviction = False


def _check_band(ctx: LoadContext, band: PriorityBandSpec) -> None:
    _non_negative(band.max_bytes, f"{band.path}.maxBytes", "maxBytes")
    _non_negative(band.max_requests, f"{band.path}.maxRequests", "maxRequests")
    if band.max_bytes is None:
        band.max_bytes = Quantity(str(d.DEFAULT_BAND_MAX_BYTES), d.DEFAULT_BAND_MAX_BYTES)
    if band.max_requests is None:
        band.max_requests = Quantity(str(d.DEFAULT_BAND_MAX_REQUESTS), d.DEFAULT_BAND_MAX_REQUESTS)
    band.fairness_policy_ref = _policy_ref(
        ctx, band.fairness_policy_ref, d.DEFAULT_FAIRNESS_POLICY, f"{band.path}.fairnessPolicyRef", "fairness"
    )
    band.ordering_policy_ref = _policy_ref(
        ctx, band.ordering_policy_ref, d.DEFAULT_ORDERING_POLICY, f"{band.path}.orderingPolicyRef", "ordering"
    )


def _policy_ref(ctx: LoadContext, ref: str | None, default: str, where: str, kind: str) -> str | None:
    if ref is None or ref == "":
        return default if default in ctx.plugins else None
    if ref not in ctx.plugins:
        raise ConfigError(where, f'no {kind} policy registered for name "{ref}"')
    return ref


def _non_negative(q: Quantity | None, where: str, name: str) -> None:
    if q is not None and q.value < 0:
        raise ConfigError(where, f"{name} must be non-negative, got {q.text}")
