"""Disaggregation deciders: per-request "should this stage run?" plugins used by the disagg handlers.

Third-party deciders only need a ``disaggregate(cycle, request, decode_endpoint) -> bool`` method.
"""

from epp.framework.interfaces import Decider, SupportsDisaggregate

__all__ = ["Decider", "SupportsDisaggregate"]
