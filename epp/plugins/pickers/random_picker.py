"""``random-picker``: uniformly random distinct endpoints, scores ignored."""

from __future__ import annotations

from epp.framework import CycleState, LLMRequest, Picker, ProfileRunResult, ScoredEndpoint, register
from epp.plugins.pickers._common import PickerParams, rng


@register
class RandomPicker(Picker):
    type_name = "random-picker"
    Params = PickerParams
    params: PickerParams

    def pick(self, cycle: CycleState, request: LLMRequest, scored: list[ScoredEndpoint]) -> ProfileRunResult:
        k = min(self.params.k, len(scored))
        return ProfileRunResult([s.endpoint for s in rng.sample(scored, k)])
