"""``data-parallel-profile-handler`` (deprecated): route to a pod's primary port, the rank in a header."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import structlog

from epp.framework import (
    CycleState,
    Endpoint,
    LLMRequest,
    Profile,
    ProfileHandler,
    ProfileRunResult,
    SchedulingError,
    SchedulingOutcome,
    SchedulingResult,
    register,
)
from epp.framework.wire import DATA_PARALLEL_HEADER

log = structlog.get_logger("epp.profile_handlers")


class PortRewrittenEndpoint(Endpoint):
    """A copy of an endpoint with another port whose in-flight count is the original's.

    Metadata is ``dataclasses.replace(origin.metadata, port=port)``; metrics are the origin's
    snapshot; attributes start empty (the reference drops them too).
    """

    __slots__ = ("_origin",)

    def __init__(self, origin: Endpoint, port: int) -> None:
        # Endpoint.__init__ is not called: it would reset ``inflight`` (and with it the origin's).
        self._origin = origin
        self.metadata = dataclasses.replace(origin.metadata, port=port)
        self.metrics = origin.metrics
        self.attributes = {}

    @property
    def inflight(self) -> int:
        return self._origin.inflight

    @inflight.setter
    def inflight(self, value: int) -> None:
        self._origin.inflight = value

    @property
    def origin(self) -> Endpoint:
        return self._origin


def rewrite_to_primary_port(
    request: LLMRequest, result: ProfileRunResult, primary_port: int
) -> ProfileRunResult:
    """Set ``x-data-parallel-host-port`` to the first target's real ``ip:port``; retarget all targets."""
    request.headers[DATA_PARALLEL_HEADER] = result.target_endpoints[0].hostport
    return ProfileRunResult([PortRewrittenEndpoint(e, primary_port) for e in result.target_endpoints])


def validate_port(name: str, port: int) -> str | None:
    if not 1 <= port <= 65535:
        return f"{name}: invalid {name}: must be between 1 and 65535, got {port}"
    return None


@dataclass(slots=True, frozen=True)
class DataParallelParams:
    primary_port: int = 8000

    def validate(self) -> str | None:
        return validate_port("primaryPort", self.primary_port)


@register
class DataParallelProfileHandler(ProfileHandler):
    type_name = "data-parallel-profile-handler"
    Params = DataParallelParams
    params: DataParallelParams

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: MutableMapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        if len(results) >= len(profiles):
            return {}
        if len(profiles) != 1:
            log.error(
                "Data Parallel profile handler requires exactly one scheduling profile",
                profile_count=len(profiles),
            )
            return {}
        return profiles

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        if len(results) != 1:
            return SchedulingOutcome.fail(
                SchedulingError(
                    "data parallel profile handler is intended to be used with a single profile, "
                    "failed to process multiple profiles"
                )
            )
        ((name, result),) = results.items()
        if result is None or not result.target_endpoints:
            return SchedulingOutcome.fail(SchedulingError(f"failed to run scheduler profile '{name}'"))
        rewritten = rewrite_to_primary_port(request, result, self.params.primary_port)
        return SchedulingOutcome.serve(SchedulingResult({name: rewritten}, name))

    def validate_profiles(self, profile_names: Sequence[str]) -> str | None:
        if len(profile_names) != 1:
            return (
                "data-parallel-profile-handler requires exactly one scheduling profile, "
                f"got {len(profile_names)}"
            )
        return None
