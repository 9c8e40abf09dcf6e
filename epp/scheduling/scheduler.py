"""The scheduler: the profile-handler loop."""

from __future__ import annotations

import time
from collections.abc import Mapping

import structlog

from epp.framework.endpoint import Endpoint
from epp.framework.errors import FiltersDrainedError, SchedulingError
from epp.framework.interfaces import ProfileHandler
from epp.framework.request import LLMRequest
from epp.framework.results import CycleState, ProfileRunResult, SchedulingOutcome
from epp.scheduling.profile import PluginTimer, SchedulerProfile

log = structlog.get_logger("epp.scheduler")

# A handler that keeps picking profiles forever is a bug; stop it instead of hanging the request.
_MAX_ROUNDS = 64


class Scheduler:
    """Asks the handler which profiles to run until it picks none, running each on the same
    candidates (a failed profile is recorded as an explicit ``None`` result); then the handler's
    ``process_results`` alone decides whether the request is served.
    """

    def __init__(
        self,
        handler: ProfileHandler,
        profiles: Mapping[str, SchedulerProfile],
        timer: PluginTimer | None = None,
    ) -> None:
        self.handler = handler
        self.profiles = dict(profiles)
        self.timer = timer

    def schedule(
        self, cycle: CycleState, request: LLMRequest, candidates: list[Endpoint]
    ) -> SchedulingOutcome:
        results: dict[str, ProfileRunResult | None] = {}
        drained: FiltersDrainedError | None = None
        timer = self.timer
        for _ in range(_MAX_ROUNDS):
            t0 = time.perf_counter() if timer else 0.0
            picked = self.handler.pick_profiles(cycle, request, self.profiles, results)
            if timer:
                timer("ProfilePicker", self.handler, time.perf_counter() - t0)
            if not picked:
                break
            for name, profile in picked.items():
                try:
                    results[name] = profile.run(cycle, request, candidates)
                except SchedulingError as e:
                    log.debug("profile failed", profile=name, request_id=request.request_id, error=str(e))
                    results[name] = None
                    if drained is None and isinstance(e, FiltersDrainedError):
                        drained = e
        else:
            return SchedulingOutcome.fail(
                SchedulingError(f"profile handler '{self.handler.name}' did not stop picking profiles")
            )
        if not results:
            return SchedulingOutcome.fail(
                SchedulingError(f"failed to run any scheduler profile for request {request.request_id}")
            )
        t0 = time.perf_counter() if timer else 0.0
        result, error = self.handler.process_results(cycle, request, results)
        if timer:
            timer("ProcessProfilesResults", self.handler, time.perf_counter() - t0)
        if error is not None and drained is not None and error.__cause__ is None:
            error.__cause__ = drained  # the director answers a drained pool 429 rejected-saturated
        return SchedulingOutcome(result, error)
