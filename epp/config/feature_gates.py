"""The ``featureGates`` of a configuration, plus the deprecated environment switch for flow control.

An entry is ``name``, ``name=true`` or ``name=false`` (the value as Go's ``strconv.ParseBool``
reads it); a gate not listed keeps its default. The effective document lists every gate that is
on, and ``name=false`` for a default-on gate that was turned off.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.config.context import LoadContext
from epp.config.schema import (
    FEATURE_GATES,
    GATE_DATA_LAYER,
    GATE_FLOW_CONTROL,
    GATE_HA_POPULATE_NON_LEADER,
)
from epp.framework.decode import did_you_mean
from epp.framework.errors import ConfigError

# Deprecated environment switch that turns the flowControl gate on.
FLOW_CONTROL_ENV = "ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER"

_TRUE = frozenset({"1", "t", "true"})
_FALSE = frozenset({"0", "f", "false"})


def parse_gate(entry: str, where: str) -> tuple[str, bool]:
    """``(name, value)`` of one ``featureGates`` entry; unknown names and bad values are errors."""
    name, sep, raw = entry.partition("=")
    if name not in FEATURE_GATES:
        hint = did_you_mean(name, list(FEATURE_GATES))
        raise ConfigError(where, f"feature gate '{name}' is unknown or unregistered{hint}")
    if not sep:
        return name, True
    value = raw.strip().lower()
    if value in _TRUE:
        return name, True
    if value in _FALSE:
        return name, False
    raise ConfigError(
        where, f"{raw} is not a valid value for the feature gate {name} (expected true or false)"
    )


def resolve_feature_gates(ctx: LoadContext, overrides: Mapping[str, bool] | None = None) -> frozenset[str]:
    """The enabled gates; ``overrides`` (``--feature-gates``) win over the document's entries. The
    document's list is rewritten to its normalized effective form."""
    values = dict(FEATURE_GATES)
    for i, entry in enumerate(ctx.doc.feature_gates):
        try:
            name, value = parse_gate(entry, f"featureGates[{i}]")
        except ConfigError as e:
            ctx.report(e)  # reported; the gate keeps its default
            continue
        values[name] = value  # a later entry wins, as in the reference
    for name, value in (overrides or {}).items():
        if name not in FEATURE_GATES:
            hint = did_you_mean(name, list(FEATURE_GATES))
            ctx.report(
                ConfigError("--feature-gates", f"feature gate '{name}' is unknown or unregistered{hint}")
            )
            continue
        values[name] = value
    if ctx.environ.get(FLOW_CONTROL_ENV, "").strip().lower() in _TRUE:
        ctx.warnings.append(f"{FLOW_CONTROL_ENV} is deprecated; add '{GATE_FLOW_CONTROL}' to featureGates")
        values[GATE_FLOW_CONTROL] = True
    if values[GATE_DATA_LAYER]:
        ctx.warnings.append(f"feature gate '{GATE_DATA_LAYER}' is deprecated and has no effect")
    if not values[GATE_HA_POPULATE_NON_LEADER]:
        ctx.warnings.append(
            f"feature gate '{GATE_HA_POPULATE_NON_LEADER}=false' has no effect: standby replicas "
            "always keep their endpoint store and metrics warm"
        )
    ctx.doc.feature_gates = [
        name if value else f"{name}=false" for name, value in values.items() if value or FEATURE_GATES[name]
    ]
    return frozenset(name for name, value in values.items() if value)
