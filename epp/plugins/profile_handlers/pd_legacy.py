"""``pd-profile-handler`` (deprecated): prefill/decode with one decider; use ``disagg-profile-handler``."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

from epp.framework import (
    CycleState,
    Handle,
    LLMRequest,
    Profile,
    ProfileHandler,
    ProfileRunResult,
    SchedulingError,
    SchedulingOutcome,
    SchedulingResult,
    register,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY
from epp.framework.interfaces import SupportsDisaggregate
from epp.framework.params import OMIT_UNSET, ensure_valid
from epp.framework.registry import deprecate
from epp.plugins.profile_handlers import _metrics
from epp.plugins.profile_handlers.data_parallel import rewrite_to_primary_port, validate_port
from epp.plugins.profile_handlers.disagg import (
    DECODE_FAILED,
    decode_stage,
    has_endpoints,
    lookup_decider,
)


@dataclass(slots=True, frozen=True)
class PdParams:
    decode_profile: str = "decode"
    prefill_profile: str = "prefill"
    prefix_plugin_type: str = "prefix-cache-scorer"
    prefix_plugin_name: str = field(default="", metadata=OMIT_UNSET)  # accepted, not used
    primary_port: int = 0
    decider_plugin_name: str = "prefix-based-pd-decider"

    def validate(self) -> str | None:
        if self.primary_port != 0 and (problem := validate_port("primaryPort", self.primary_port)):
            return problem
        if not self.decider_plugin_name:
            return "deciderPluginName: decider plugin name is not defined"
        return None


@register
class PdProfileHandler(ProfileHandler):
    type_name = "pd-profile-handler"
    Params = PdParams
    params: PdParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(self, name: str, params: PdParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        ensure_valid(params)  # also when constructed directly, not through the loader
        decider_name = params.decider_plugin_name
        self.decider: SupportsDisaggregate = lookup_decider(
            handle,
            "deciderPluginName",
            decider_name,
            not_found=f"invalid decider plugin type: {decider_name}",
            not_a_decider=f"decider plugin of type: {decider_name} does not implement pdDeciderPlugin",
        )

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: MutableMapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        decode = self.params.decode_profile
        pending, decode_endpoint = decode_stage(decode, profiles, results)
        if decode_endpoint is None:
            return pending
        prefill = self.params.prefill_profile
        prefill_profile = profiles.get(prefill)
        if prefill_profile is not None and prefill not in results:
            if self.decider.disaggregate(cycle, request, decode_endpoint):
                return {prefill: prefill_profile}
            results[prefill] = None  # declined: recorded so that it is not evaluated again
        used = prefill != decode and has_endpoints(results.get(prefill))
        _metrics.record_pd_decision(
            self.name,
            self.type_name,
            request.target_model,
            _metrics.PREFILL_DECODE if used else _metrics.DECODE_ONLY,
        )
        return {}

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        decode = self.params.decode_profile
        decode_result = results.get(decode)
        if decode_result is None or not decode_result.target_endpoints:
            return SchedulingOutcome.fail(SchedulingError(DECODE_FAILED))
        if self.params.primary_port:
            decode_result = rewrite_to_primary_port(request, decode_result, self.params.primary_port)
        kept: dict[str, ProfileRunResult | None] = {decode: decode_result}
        prefill = self.params.prefill_profile
        prefill_result = results.get(prefill)
        if prefill_result is not None and prefill != decode:
            kept[prefill] = prefill_result
        return SchedulingOutcome.serve(SchedulingResult(kept, decode))

    def validate_profiles(self, profile_names: Sequence[str]) -> str | None:
        decode = self.params.decode_profile
        if decode not in profile_names:
            return (
                f"pd-profile-handler needs a decode profile named '{decode}' "
                f"(profiles: {', '.join(profile_names) or 'none'})"
            )
        return None


deprecate(PdProfileHandler.type_name, "disagg-profile-handler", since="v0.7.0", removal="v0.11.0")
