"""``disagg-profile-handler``: the unified D, P/D, E/PD and E/P/D handler (also a PreRequest plugin)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import structlog

from epp.framework import (
    ConfigError,
    CycleState,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
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
from epp.plugins.profile_handlers import _metrics
from epp.plugins.profile_handlers.disagg_headers import set_disagg_headers

log = structlog.get_logger("epp.profile_handlers")

DEFAULT_DECODE_PROFILE = "decode"
DEFAULT_PREFILL_PROFILE = "prefill"
DEFAULT_ENCODE_PROFILE = "encode"

DECODE_FAILED = "failed to find available decode workers"

STAGE_ORDER_DECODE_FIRST = "decode-first"
STAGE_ORDER_PREFILL_FIRST = "prefill-first"

PEER_ENDPOINT_KEY = "peer-endpoint/disagg-profile-handler"
"""Cycle-state key of the endpoint picked by the stage that ran before (read by topology plugins)."""


def parse_stage_order(value: str) -> str | None:
    """``decode-first`` or ``prefill-first`` (case, ``-`` and ``_`` ignored; ``decode``/``prefill``
    and empty accepted), None when ``value`` is neither."""
    folded = value.lower().replace("-", "").replace("_", "")
    if folded in ("", "decodefirst", "decode"):
        return STAGE_ORDER_DECODE_FIRST
    if folded in ("prefillfirst", "prefill"):
        return STAGE_ORDER_PREFILL_FIRST
    return None


_MIX_ERROR = (
    "cannot mix deprecated flat parameters (decodeProfile, prefillProfile, encodeProfile, "
    "deciderPluginName, prefillDeciderPluginName, encodeDeciderPluginName) "
    "with nested parameters (profiles, deciders): use one format or the other"
)


@dataclass(slots=True, frozen=True)
class DisaggProfiles:
    """Profile names per stage (empty = the stage's default name)."""

    decode: str = ""
    prefill: str = ""
    encode: str = ""


@dataclass(slots=True, frozen=True)
class DisaggDeciders:
    """Decider plugin names per optional stage (empty = the stage never runs)."""

    prefill: str = ""
    encode: str = ""


@dataclass(slots=True, frozen=True)
class DisaggParams:
    """Nested ``profiles``/``deciders``, or the deprecated flat keys (promoted on construction)."""

    profiles: DisaggProfiles = field(default_factory=DisaggProfiles)
    deciders: DisaggDeciders = field(default_factory=DisaggDeciders)
    stage_order: str = STAGE_ORDER_DECODE_FIRST
    # deprecated flat form (promoted into profiles/deciders on construction)
    decode_profile: str = field(default="", metadata=OMIT_UNSET)
    prefill_profile: str = field(default="", metadata=OMIT_UNSET)
    encode_profile: str = field(default="", metadata=OMIT_UNSET)
    prefill_decider_plugin_name: str = field(default="", metadata=OMIT_UNSET)
    encode_decider_plugin_name: str = field(default="", metadata=OMIT_UNSET)
    decider_plugin_name: str = field(default="", metadata=OMIT_UNSET)

    def __post_init__(self) -> None:
        order = parse_stage_order(self.stage_order)
        if order is not None:
            object.__setattr__(self, "stage_order", order)
        flat = self._flat_keys()
        if flat and self._has_nested():
            return  # left as given: validate() reports the mix
        if flat:
            log.info("Deprecated: flat parameters, migrate to nested profiles/deciders", keys=flat)
        p, d = self.profiles, self.deciders
        profiles = DisaggProfiles(
            decode=self.decode_profile or p.decode or DEFAULT_DECODE_PROFILE,
            prefill=self.prefill_profile or p.prefill or DEFAULT_PREFILL_PROFILE,
            encode=self.encode_profile or p.encode or DEFAULT_ENCODE_PROFILE,
        )
        deciders = DisaggDeciders(
            prefill=self.decider_plugin_name or self.prefill_decider_plugin_name or d.prefill,
            encode=self.encode_decider_plugin_name or d.encode,
        )
        for name, value in (
            ("profiles", profiles),
            ("deciders", deciders),
            ("decode_profile", ""),
            ("prefill_profile", ""),
            ("encode_profile", ""),
            ("prefill_decider_plugin_name", ""),
            ("encode_decider_plugin_name", ""),
            ("decider_plugin_name", ""),
        ):
            object.__setattr__(self, name, value)

    def validate(self) -> str | None:
        flat = self._flat_keys()
        if flat and self._has_nested():
            return f"{flat[0]}: {_MIX_ERROR}"
        if parse_stage_order(self.stage_order) is None:
            return (
                f'stageOrder: invalid stage order "{self.stage_order}", must be '
                f'"{STAGE_ORDER_DECODE_FIRST}" or "{STAGE_ORDER_PREFILL_FIRST}"'
            )
        if self.stage_order == STAGE_ORDER_PREFILL_FIRST and self.deciders.prefill:
            return (
                f"deciders.prefill: prefill decider is not supported in {STAGE_ORDER_PREFILL_FIRST} "
                "stage order"
            )
        return None

    def _flat_keys(self) -> list[str]:
        """YAML names of the deprecated flat keys that are set, in declaration order."""
        pairs = (
            ("decodeProfile", self.decode_profile),
            ("prefillProfile", self.prefill_profile),
            ("encodeProfile", self.encode_profile),
            ("prefillDeciderPluginName", self.prefill_decider_plugin_name),
            ("encodeDeciderPluginName", self.encode_decider_plugin_name),
            ("deciderPluginName", self.decider_plugin_name),
        )
        return [key for key, value in pairs if value]

    def _has_nested(self) -> bool:
        p, d = self.profiles, self.deciders
        return bool(p.decode or p.prefill or p.encode or d.prefill or d.encode)


def lookup_decider(
    handle: Handle | None, field_path: str, name: str, *, not_found: str, not_a_decider: str
) -> SupportsDisaggregate:
    """The decider plugin named ``name`` (declared earlier); ConfigError at ``field_path`` with
    ``not_found`` when there is none, with ``not_a_decider`` when it cannot decide."""
    plugin = handle.plugin(name) if handle is not None else None
    if plugin is None:
        raise ConfigError(field_path, not_found)
    if not isinstance(plugin, SupportsDisaggregate):
        raise ConfigError(field_path, not_a_decider)
    return plugin


def resolve_decider(
    handle: Handle | None, field_path: str, name: str, kind: str
) -> SupportsDisaggregate | None:
    """The decider plugin named ``name`` (declared earlier), None when unset; ConfigError otherwise."""
    if not name:
        return None
    return lookup_decider(
        handle,
        field_path,
        name,
        not_found=f"{field_path} plugin not found: {name}",
        not_a_decider=f"plugin {name} does not implement {kind}",
    )


def has_endpoints(result: ProfileRunResult | None) -> bool:
    return result is not None and bool(result.target_endpoints)


def decode_stage(
    decode: str, profiles: Mapping[str, Profile], results: Mapping[str, ProfileRunResult | None]
) -> tuple[Mapping[str, Profile], Endpoint | None]:
    """Decode runs first: ``(profiles to run now, None)`` until it has, then ``({}, its first target)``.

    A decode profile that is missing or found no endpoint leaves nothing to run.
    """
    if decode not in results:
        profile = profiles.get(decode)
        return ({decode: profile} if profile is not None else {}), None
    decode_result = results[decode]
    if decode_result is None or not decode_result.target_endpoints:
        return {}, None
    return {}, decode_result.target_endpoints[0]


@register
class DisaggProfileHandler(ProfileHandler, PreRequest):
    type_name = "disagg-profile-handler"
    Params = DisaggParams
    params: DisaggParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(self, name: str, params: DisaggParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        ensure_valid(params)  # also when constructed directly, not through the loader
        self.decode_profile = params.profiles.decode
        self.prefill_profile = params.profiles.prefill
        self.encode_profile = params.profiles.encode
        self.prefill_first = params.stage_order == STAGE_ORDER_PREFILL_FIRST
        self.prefill_decider = resolve_decider(
            handle, "deciders.prefill", params.deciders.prefill, "prefillDeciderPlugin"
        )
        self.encode_decider = resolve_decider(
            handle, "deciders.encode", params.deciders.encode, "encodeDeciderPlugin"
        )
        if self.prefill_decider is None and not self.prefill_first:
            log.info("No deciders.prefill configured, P/D disaggregation disabled", plugin=name)
        if self.encode_decider is None:
            log.info("No deciders.encode configured, E disaggregation disabled", plugin=name)

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: MutableMapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        if self.prefill_first:
            return self._pick_prefill_first(cycle, request, profiles, results)
        pending, decode_endpoint = decode_stage(self.decode_profile, profiles, results)
        if decode_endpoint is None:
            return pending

        for stage, decider in (
            (self.encode_profile, self.encode_decider),
            (self.prefill_profile, self.prefill_decider),
        ):
            profile = profiles.get(stage)
            if profile is None or stage in results:
                continue
            if decider is not None and decider.disaggregate(cycle, request, decode_endpoint):
                if stage == self.prefill_profile:
                    cycle[PEER_ENDPOINT_KEY] = decode_endpoint
                return {stage: profile}
            results[stage] = None  # declined: recorded so that it is not evaluated again

        self._record_decision(request, results)
        return {}

    def _pick_prefill_first(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: MutableMapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        """Prefill (no decider), then encode (its decider sees no decode endpoint), then decode."""
        if self.decode_profile in results:
            if has_endpoints(results[self.decode_profile]):
                self._record_decision(request, results)
            return {}
        prefill = profiles.get(self.prefill_profile)
        if prefill is not None and self.prefill_profile not in results:
            return {self.prefill_profile: prefill}
        encode = profiles.get(self.encode_profile)
        if encode is not None and self.encode_profile not in results:
            decider = self.encode_decider
            if decider is not None and decider.disaggregate(cycle, request, cast(Endpoint, None)):
                return {self.encode_profile: encode}
            results[self.encode_profile] = None
        decode = profiles.get(self.decode_profile)
        if decode is None:
            return {}
        prefill_result = results.get(self.prefill_profile)
        if prefill_result is not None and prefill_result.target_endpoints:
            cycle[PEER_ENDPOINT_KEY] = prefill_result.target_endpoints[0]
        return {self.decode_profile: decode}

    def _record_decision(self, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]) -> None:
        decision = _metrics.decision_type(
            encode_used=has_endpoints(results.get(self.encode_profile)),
            prefill_used=has_endpoints(results.get(self.prefill_profile)),
        )
        _metrics.record_disagg_decision(self.name, self.type_name, request.target_model, decision)

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        decode_result = results.get(self.decode_profile)
        if decode_result is None or not decode_result.target_endpoints:
            return SchedulingOutcome.fail(SchedulingError(DECODE_FAILED))
        kept: dict[str, ProfileRunResult | None] = {self.decode_profile: decode_result}
        for stage in (self.prefill_profile, self.encode_profile):
            stage_result = results.get(stage)
            if stage_result is not None and stage != self.decode_profile:
                kept[stage] = stage_result
        return SchedulingOutcome.serve(SchedulingResult(kept, self.decode_profile))

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        set_disagg_headers(request, result, self.prefill_profile, self.encode_profile)

    def validate_profiles(self, profile_names: Sequence[str]) -> str | None:
        if self.decode_profile not in profile_names:
            return (
                f"disagg-profile-handler needs a decode profile named '{self.decode_profile}' "
                f"(profiles: {', '.join(profile_names) or 'none'})"
            )
        return None
