"""Flow-control settings: the effective ``flowControl`` section, resolved to numbers and plugins."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from epp.config.schema import FlowControlSpec, PriorityBandSpec
from epp.framework.interfaces import FairnessPolicy, OrderingPolicy, Plugin, UsageLimitPolicy


@dataclass(slots=True, frozen=True)
class BandSettings:
    """One band's caps (0: unlimited), policies and queue-wait budget (None: the global one)."""

    max_requests: int
    max_bytes: int
    fairness: FairnessPolicy
    ordering: OrderingPolicy
    request_ttl: float | None = None


@dataclass(slots=True)
class FlowControlSettings:
    """Everything the controller needs; TTLs in seconds (0: none)."""

    default_band: BandSettings
    usage_limit: UsageLimitPolicy | None = None
    negative_band: BandSettings | None = None
    bands: dict[int, BandSettings] = field(default_factory=dict)
    max_requests: int = 0
    max_bytes: int = 0
    request_ttl: float = 60.0
    no_endpoint_ttl: float = 60.0
    eviction: bool = False

    def band(self, priority: int) -> BandSettings:
        """The settings of ``priority``: its own band, else the negative or the default template."""
        own = self.bands.get(priority)
        if own is not None:
            return own
        if priority < 0 and self.negative_band is not None:
            return self.negative_band
        return self.default_band

    def longest_ttl(self) -> float:
        """The longest queue-wait budget of any band (0 when one waits without limit)."""
        ttls = [self.request_ttl, self.no_endpoint_ttl]
        for b in (self.default_band, self.negative_band, *self.bands.values()):
            if b is not None and b.request_ttl is not None:
                ttls.append(b.request_ttl)
        return 0.0 if any(t <= 0 for t in ttls) else max(ttls)


def settings_from_spec(spec: FlowControlSpec, plugins: Mapping[str, Plugin]) -> FlowControlSettings:
    """Settings from a checked, defaults-filled ``flowControl`` section (``check_flow_control``)."""

    def band(b: PriorityBandSpec) -> BandSettings:
        fairness = plugins.get(b.fairness_policy_ref or "")
        ordering = plugins.get(b.ordering_policy_ref or "")
        if not isinstance(fairness, FairnessPolicy) or not isinstance(ordering, OrderingPolicy):
            raise ValueError(f"{b.path}: the band has no fairness or ordering policy plugin")
        return BandSettings(
            max_requests=b.max_requests.value if b.max_requests is not None else 0,
            max_bytes=b.max_bytes.value if b.max_bytes is not None else 0,
            fairness=fairness,
            ordering=ordering,
            request_ttl=b.default_request_ttl.seconds if b.default_request_ttl is not None else None,
        )

    assert spec.default_priority_band is not None
    usage = plugins.get(spec.usage_limit_policy_plugin_ref or "")
    return FlowControlSettings(
        default_band=band(spec.default_priority_band),
        usage_limit=usage if isinstance(usage, UsageLimitPolicy) else None,
        negative_band=(
            band(spec.default_negative_priority_band) if spec.default_negative_priority_band else None
        ),
        bands={b.priority or 0: band(b) for b in spec.priority_bands},
        max_requests=spec.max_requests.value if spec.max_requests is not None else 0,
        max_bytes=spec.max_bytes.value if spec.max_bytes is not None else 0,
        request_ttl=spec.default_request_ttl.seconds if spec.default_request_ttl is not None else 60.0,
        no_endpoint_ttl=(
            spec.no_endpoint_request_ttl.seconds if spec.no_endpoint_request_ttl is not None else 60.0
        ),
        eviction=bool(spec.enable_eviction),
    )
