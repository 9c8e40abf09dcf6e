"""``single-profile-handler``: run the one profile; its failure fails the request.

Type: ``single-profile-handler``. Parameters: none. Added automatically when a config has exactly
one profile and no handler; a config with more than one profile is rejected at load.
``pick_profiles`` returns every profile not yet run; ``process_results`` errors when the profile
failed (``failed to run scheduler profile '<name>'``), otherwise that profile is primary.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

from epp.framework import (
    CycleState,
    LLMRequest,
    Profile,
    ProfileHandler,
    ProfileRunResult,
    SchedulingError,
    SchedulingOutcome,
    SchedulingResult,
    register,
)


@register
class SingleProfileHandler(ProfileHandler):
    type_name = "single-profile-handler"

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: MutableMapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        if len(results) >= len(profiles):
            return {}
        return {n: p for n, p in profiles.items() if n not in results}

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        if len(results) != 1:
            return SchedulingOutcome.fail(
                SchedulingError(
                    "single profile handler is intended to be used with a single profile, "
                    "failed to process multiple profiles"
                )
            )
        ((name, result),) = results.items()
        if result is None:
            return SchedulingOutcome.fail(SchedulingError(f"failed to run scheduler profile '{name}'"))
        return SchedulingOutcome.serve(SchedulingResult({name: result}, name))

    def validate_profiles(self, profile_names: Sequence[str]) -> str | None:
        if len(profile_names) > 1:
            return "SingleProfileHandler cannot support multiple scheduling profiles"
        return None
