"""``always-disagg-pd-decider``: always run the disaggregated stage."""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, LLMRequest, register
from epp.framework.interfaces import Decider


@register
class AlwaysDisaggDecider(Decider):
    type_name = "always-disagg-pd-decider"

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
        return True
