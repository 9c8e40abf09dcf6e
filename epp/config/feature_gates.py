"""The ``featureGates`` of a configuration, plus the deprecated environment switch for flow control."""

from __future__ import annotations

from epp.config.context import LoadContext
from epp.config.schema import FEATURE_GATES, GATE_DATA_LAYER, GATE_FLOW_CONTROL
from epp.framework.errors import ConfigError

# Deprecated environment switch that appends the flowControl gate.
FLOW_CONTROL_ENV = "ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER"


def resolve_feature_gates(ctx: LoadContext) -> frozenset[str]:
    """Check the gates, deduplicate them into the document and warn about deprecated ones."""
    gates: list[str] = []
    for i, gate in enumerate(ctx.doc.feature_gates):
        if gate not in FEATURE_GATES:
            raise ConfigError(f"featureGates[{i}]", f"feature gate '{gate}' is unknown or unregistered")
        if gate not in gates:
            gates.append(gate)
    if ctx.environ.get(FLOW_CONTROL_ENV, "").strip().lower() in ("1", "t", "true"):
        ctx.warnings.append(f"{FLOW_CONTROL_ENV} is deprecated; add '{GATE_FLOW_CONTROL}' to featureGates")
        if GATE_FLOW_CONTROL not in gates:
            gates.append(GATE_FLOW_CONTROL)
    if GATE_DATA_LAYER in gates:
        ctx.warnings.append(f"feature gate '{GATE_DATA_LAYER}' is deprecated and has no effect")
    ctx.doc.feature_gates = gates
    return frozenset(gates)
