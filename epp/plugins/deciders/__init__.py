"""Disaggregation deciders: per-request "should this stage run?" plugins used by the disagg handlers.

A decider is declared in ``plugins:`` *before* the profile handler that names it (the handler
resolves it through the factory handle). ``Decider`` is the base class of the built-in deciders;
third-party deciders only need a ``disaggregate(cycle, request, decode_endpoint) -> bool`` method.
"""

from epp.framework.interfaces import Decider, SupportsDisaggregate

__all__ = ["Decider", "SupportsDisaggregate"]
