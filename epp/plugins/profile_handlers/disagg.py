"""``disagg-profile-handler``: the unified D, P/D, E/PD and E/P/D handler (also a PreRequest plugin).

Type: ``disagg-profile-handler``. Parameters (nested form)::

    profiles: {decode: decode, prefill: prefill, encode: encode}   # profile names (these defaults)
    deciders: {prefill: <decider plugin>, encode: <decider plugin>} # optional; none = stage off

Legacy flat keys are still accepted: ``decodeProfile``, ``prefillProfile``, ``encodeProfile``,
``prefillDeciderPluginName``, ``encodeDeciderPluginName`` and ``deciderPluginName`` (an alias of the
prefill decider that wins over ``prefillDeciderPluginName``). Using a flat key together with a
nested one is an error (``cannot mix deprecated flat parameters ...``). Empty strings mean "not set"
(as in the reference); the flat form is promoted to the nested one when the parameters are built,
so the effective configuration always shows the nested form with the defaults filled in.

Deciders are plugins declared *earlier* in ``plugins:`` and resolved through the factory handle when
this handler is created: an unknown name → ``deciders.prefill plugin not found: <n>``; a plugin
without ``disaggregate`` → ``plugin <n> does not implement prefillDeciderPlugin`` (``encode`` alike).

``pick_profiles`` (one stage per call):

1. decode has not run → run the decode profile (none configured → run nothing: the cycle fails);
2. decode failed or picked nothing → stop;
3. an encode profile exists and was not evaluated → run it if the encode decider says so for the
   first decode endpoint, else record ``results[encode] = None`` (skipped);
4. the same for the prefill profile with the prefill decider;
5. record ``llm_d_inference_scheduler_disagg_decision_total{model_name, decision_type}`` (and the
   deprecated ``..._pd_decision_total``) from the stages that produced endpoints: ``decode-only``,
   ``prefill-decode``, ``encode-decode`` or ``encode-prefill-decode``; stop.

``process_results`` alone decides whether a failed stage fails the request: decode ``None`` or empty
→ error ``failed to find available decode workers`` (HTTP 429); otherwise decode is the primary
profile and every non-``None`` prefill/encode result is kept. A failed or skipped prefill therefore
means decode-only serving, with no ``x-prefiller-host-port`` header.

``pre_request``: delete ``x-prefiller-host-port`` / ``x-encoder-hosts-ports`` from the request
headers, then set them from the prefill result's first endpoint and from all encode endpoints
(``disagg_headers.set_disagg_headers``).

The handler ``consumes`` ``PrefixCacheMatchInfoKey`` like the reference (the approximate prefix
producer is auto-created for the prefix-based decider). ``validate_profiles`` rejects a config
without the decode profile (the reference would fail every request instead). Profiles other than
the three configured names are never run.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

import structlog

from epp.framework import (
    ConfigError,
    CycleState,
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
from epp.framework.params import ensure_valid
from epp.plugins.profile_handlers import _metrics
from epp.plugins.profile_handlers.disagg_headers import set_disagg_headers

log = structlog.get_logger("epp.profile_handlers")

DEFAULT_DECODE_PROFILE = "decode"
DEFAULT_PREFILL_PROFILE = "prefill"
DEFAULT_ENCODE_PROFILE = "encode"

DECODE_FAILED = "failed to find available decode workers"

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
    # deprecated flat form
    decode_profile: str = ""
    prefill_profile: str = ""
    encode_profile: str = ""
    prefill_decider_plugin_name: str = ""
    encode_decider_plugin_name: str = ""
    decider_plugin_name: str = ""

    def __post_init__(self) -> None:
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


def resolve_decider(
    handle: Handle | None, field_path: str, name: str, kind: str
) -> SupportsDisaggregate | None:
    """The decider plugin named ``name`` (declared earlier), None when unset; ConfigError otherwise."""
    if not name:
        return None
    plugin = handle.plugin(name) if handle is not None else None
    if plugin is None:
        raise ConfigError(field_path, f"{field_path} plugin not found: {name}")
    if not isinstance(plugin, SupportsDisaggregate):
        raise ConfigError(field_path, f"plugin {name} does not implement {kind}")
    return plugin


def has_endpoints(result: ProfileRunResult | None) -> bool:
    return result is not None and bool(result.target_endpoints)


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
        self.prefill_decider = resolve_decider(
            handle, "deciders.prefill", params.deciders.prefill, "prefillDeciderPlugin"
        )
        self.encode_decider = resolve_decider(
            handle, "deciders.encode", params.deciders.encode, "encodeDeciderPlugin"
        )
        if self.prefill_decider is None:
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
        decode = self.decode_profile
        if decode not in results:
            profile = profiles.get(decode)
            return {decode: profile} if profile is not None else {}
        decode_result = results[decode]
        if decode_result is None or not decode_result.target_endpoints:
            return {}
        decode_endpoint = decode_result.target_endpoints[0]

        for stage, decider in (
            (self.encode_profile, self.encode_decider),
            (self.prefill_profile, self.prefill_decider),
        ):
            profile = profiles.get(stage)
            if profile is None or stage in results:
                continue
            if decider is not None and decider.disaggregate(cycle, request, decode_endpoint):
                return {stage: profile}
            results[stage] = None  # declined: recorded so that it is not evaluated again

        decision = _metrics.decision_type(
            encode_used=has_endpoints(results.get(self.encode_profile)),
            prefill_used=has_endpoints(results.get(self.prefill_profile)),
        )
        _metrics.record_disagg_decision(request.target_model, decision)
        return {}

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
