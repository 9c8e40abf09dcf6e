"""``header-profile-handler``: run the one scheduling profile a request header names."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import structlog

from epp.framework import (
    CycleState,
    ErrorCode,
    Handle,
    InferenceError,
    LLMRequest,
    Profile,
    ProfileHandler,
    ProfileRunResult,
    SchedulingError,
    SchedulingOutcome,
    SchedulingResult,
    Stability,
    register,
)

__all__ = ["HeaderProfileHandler", "HeaderProfileParams"]

log = structlog.get_logger("epp.profile_handlers")

DEFAULT_HEADER = "EPP-Profile"
DEFAULT_PROFILE = "decode"


@dataclass(slots=True, frozen=True)
class HeaderProfileParams:
    """``headerName`` (case-insensitive; empty = ``EPP-Profile``), ``defaultProfile`` (empty = ``decode``)."""

    header_name: str = DEFAULT_HEADER
    default_profile: str = DEFAULT_PROFILE


@register
class HeaderProfileHandler(ProfileHandler):
    type_name = "header-profile-handler"
    stability = Stability.ALPHA
    Params = HeaderProfileParams
    params: HeaderProfileParams

    def __init__(self, name: str, params: HeaderProfileParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.header = params.header_name.strip().lower() or DEFAULT_HEADER.lower()
        self.default_profile = params.default_profile.strip() or DEFAULT_PROFILE
        self._error_key = f"header-profile-error:{name}"

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: MutableMapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        if results:  # the chosen profile has run
            return {}
        if len(profiles) == 1:
            return dict(profiles)
        asked = request.headers.get(self.header, "").strip()
        chosen = asked or self.default_profile
        profile = profiles.get(chosen)
        if profile is not None:
            return {chosen: profile}
        if asked:
            reason = f'no scheduling profile configured for "{self.header}" header value "{asked}"'
        else:
            reason = (
                f'missing "{self.header}" header, and defaultProfile "{self.default_profile}" '
                "is not a configured scheduling profile"
            )
        log.debug("no scheduling profile selected", handler=self.name, reason=reason)
        cycle[self._error_key] = reason
        results[chosen] = None  # recorded so that process_results reports the reason
        return {}

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        reason = cycle.get(self._error_key)
        if reason is not None:
            return SchedulingOutcome.fail(
                InferenceError(ErrorCode.BAD_REQUEST, f"header profile handler: {reason}")
            )
        if len(results) != 1:
            return SchedulingOutcome.fail(
                SchedulingError(
                    "header profile handler is intended to run a single profile per request, "
                    f"got {len(results)}"
                )
            )
        ((name, result),) = results.items()
        if result is None:
            return SchedulingOutcome.fail(SchedulingError(f"failed to run scheduler profile '{name}'"))
        return SchedulingOutcome.serve(SchedulingResult({name: result}, name))

    def validate_profiles(self, profile_names: Sequence[str]) -> str | None:
        if len(profile_names) > 1 and self.default_profile not in profile_names:
            log.warning(
                "defaultProfile is not a configured scheduling profile: "
                "requests without the header will fail",
                handler=self.name,
                default_profile=self.default_profile,
                header=self.header,
            )
        return None
