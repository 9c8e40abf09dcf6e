"""Scheduling profiles: their validation, system defaults (handler, picker, weights), the scheduler.

A config that declares no scheduling at all gets the default profile (``with_default_scheduling``).
"""

from __future__ import annotations

from typing import Any

from epp.config import defaults as d
from epp.config.context import DependentError, LoadContext
from epp.config.removed import PRECISE_SCORER
from epp.config.schema import ProfilePluginSpec, ProfileSpec
from epp.framework import registry
from epp.framework.errors import ConfigError
from epp.framework.interfaces import (
    Admitter,
    DataProducer,
    DataSource,
    Extractor,
    Filter,
    Picker,
    PreRequest,
    ProfileHandler,
    RequestDone,
    RequestHeaderProcessor,
    Responder,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
    Scorer,
    Screener,
    SupportsDisaggregate,
)
from epp.scheduling import Scheduler, SchedulerProfile, WeightedScorer


def with_default_scheduling(raw: Any) -> Any:
    """Give a raw document that declares no scheduling at all the default scheduling.

    Differs from the reference on purpose: there, a config without profiles gets one profile of
    whatever filters, scorers and pickers it declares, so a file that only sets up discovery (or a
    data source) routes at random. Users expect the default profile (queue-scorer x2,
    kv-cache-utilization-scorer x2, prefix-cache-scorer x3), which is what an empty config gets.
    Applies only when there are no ``schedulingProfiles`` and no filter, scorer, picker or profile
    handler among the plugins.
    """
    if not isinstance(raw, dict) or raw.get("schedulingProfiles"):
        return raw
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(p, dict) for p in plugins):
        return raw  # malformed: let strict decoding report it
    scheduling_kinds = (Filter, Scorer, Picker, ProfileHandler)
    for p in plugins:
        if p.get("type") == PRECISE_SCORER:
            return raw  # not registered, but loaded as a prefix-cache-scorer (epp.config.removed)
        cls = registry.lookup(str(p.get("type", "")))
        # A saturation detector (also a Filter) declared to tune admission is not scheduling.
        if cls is not None and issubclass(cls, scheduling_kinds) and not issubclass(cls, SaturationDetector):
            return raw
    default = d.default_document()
    taken = {p.get("name") or p.get("type") for p in plugins}
    added = []
    for p in default["plugins"]:
        cls = registry.lookup(p["type"])
        if cls is not None and issubclass(cls, (*scheduling_kinds, DataProducer)) and p["type"] not in taken:
            added.append(p)
    return {**raw, "plugins": [*plugins, *added], "schedulingProfiles": default["schedulingProfiles"]}


def validate_profiles(ctx: LoadContext) -> None:
    """Profiles have unique names and every ``pluginRef`` names a declared plugin.

    Every problem is reported; an entry that names no loaded plugin is then dropped, so the later
    phases see only loaded plugins (a reference to a plugin that failed to load is not reported
    again: its own error is the cause).
    """
    seen: set[str] = set()
    for i, prof in enumerate(ctx.doc.scheduling_profiles):
        if not prof.name:
            ctx.report(ConfigError(f"{prof.path}.name", f"schedulingProfiles[{i}] is missing a name"))
        elif prof.name in seen:
            ctx.report(
                ConfigError(f"{prof.path}.name", f"schedulingProfiles[{i}] has duplicate name '{prof.name}'")
            )
        seen.add(prof.name)
        kept = []
        for j, ref in enumerate(prof.plugins):
            if not ref.plugin_ref:
                ctx.report(
                    ConfigError(
                        f"{ref.path}.pluginRef",
                        f"schedulingProfiles[{prof.name}].plugins[{j}] is missing a 'pluginRef'",
                    )
                )
            elif ref.plugin_ref in ctx.plugins:
                kept.append(ref)
            elif ref.plugin_ref not in ctx.failed:
                ctx.report(
                    ConfigError(
                        f"{ref.path}.pluginRef",
                        f"schedulingProfiles[{prof.name}] references undefined plugin '{ref.plugin_ref}'",
                    )
                )
        prof.plugins[:] = kept


def apply_scheduling_defaults(ctx: LoadContext) -> None:
    """The implicit profile, a single-profile handler, a picker for each profile, scorer weight 1."""
    plugins = ctx.plugins
    profiles = ctx.doc.scheduling_profiles
    if not profiles:
        # Differs from the reference, which also puts saturation detectors (they are filters)
        # into the implicit profile: a detector declared to tune admission should not start
        # filtering endpoints unless a profile references it.
        refs = [
            ProfilePluginSpec(name, None, ctx.specs[name].path)
            for name, p in plugins.items()
            if isinstance(p, Filter | Scorer | Picker) and not isinstance(p, SaturationDetector)
        ]
        profiles.append(ProfileSpec(d.DEFAULT_PROFILE_NAME, refs, "schedulingProfiles[0]"))
    if len(profiles) == 1 and not any(isinstance(p, ProfileHandler) for p in plugins.values()):
        ctx.add_default(d.SINGLE_PROFILE_HANDLER, "scheduling")
    lacking = [
        prof for prof in profiles if not any(isinstance(plugins[r.plugin_ref], Picker) for r in prof.plugins)
    ]
    if lacking:
        name = next((n for n, p in plugins.items() if isinstance(p, Picker)), "")
        if not name:
            name = ctx.add_default(d.DEFAULT_PICKER, "scheduling").name
        for prof in lacking:
            where = f"{prof.path}.plugins[{len(prof.plugins)}]"
            prof.plugins.append(ProfilePluginSpec(name, None, where))
    for prof in profiles:
        for ref in prof.plugins:
            if ref.weight is None and isinstance(plugins[ref.plugin_ref], Scorer):
                ref.weight = 1.0


def build_scheduler(ctx: LoadContext) -> Scheduler:
    """The scheduler of the profiles and the one profile handler."""
    profiles = {prof.name: _assemble_profile(ctx, prof) for prof in ctx.doc.scheduling_profiles}
    handlers = [p for p in ctx.plugins.values() if isinstance(p, ProfileHandler)]
    if len(handlers) > 1:
        a, b = handlers[0].name, handlers[1].name
        raise ConfigError(
            ctx.specs[b].path, f"multiple profile handlers found ('{a}', '{b}'); only one is allowed"
        )
    if not handlers:
        failed = [n for n, cls in ctx.failed.items() if cls is not None and issubclass(cls, ProfileHandler)]
        if failed:  # the declared handler failed to load: its error says why
            raise DependentError("schedulingProfiles", f"profile handler '{failed[0]}' failed to load")
        raise ConfigError(
            "schedulingProfiles",
            f"no profile handler configured ({len(profiles)} scheduling profiles need one, "
            "e.g. disagg-profile-handler)",
        )
    handler = handlers[0]
    problem = handler.validate_profiles(list(profiles))
    if problem:
        raise ConfigError(ctx.specs[handler.name].path, problem)
    return Scheduler(handler, profiles)


def warn_multi_endpoint_pickers(ctx: LoadContext, scheduler: Scheduler) -> None:
    """Warn once per picker configured to return more than one endpoint."""
    warned: set[str] = set()
    for sp in scheduler.profiles.values():
        picker = sp.picker
        if picker is None or picker.name in warned:
            continue
        n = getattr(picker.params, "max_num_of_endpoints", 1)
        if isinstance(n, int) and n > 1:
            warned.add(picker.name)
            ctx.warnings.append(
                f"{ctx.specs[picker.name].path}.parameters.maxNumOfEndpoints: picker '{picker.name}' "
                f"returns up to {n} endpoints as a comma-separated destination list, which Envoy's "
                "ORIGINAL_DST cluster cannot parse (it answers 503); use 1 unless the proxy "
                "implements fallback lists"
            )


# Kinds a plugin is used as outside scheduling profiles: a filter, scorer or picker that is also one
# of these does something even when no profile names it.
_USED_OUTSIDE_PROFILES: tuple[type, ...] = (
    SaturationDetector,
    ProfileHandler,
    DataProducer,
    DataSource,
    Extractor,
    PreRequest,
    RequestDone,
    RequestHeaderProcessor,
    ResponseHeaderProcessor,
    ResponseBodyProcessor,
    Admitter,
    Screener,
    Responder,
    SupportsDisaggregate,
)


def warn_unused_scheduling_plugins(ctx: LoadContext) -> None:
    """Warn about a filter, scorer or picker that no scheduling profile names and nothing else uses:
    it is created and then does nothing (the usual cause: a ``pluginRef`` forgotten in a profile)."""
    referenced = {ref.plugin_ref for prof in ctx.doc.scheduling_profiles for ref in prof.plugins}
    for name, plugin in ctx.plugins.items():
        if (
            isinstance(plugin, Filter | Scorer | Picker)
            and not isinstance(plugin, _USED_OUTSIDE_PROFILES)
            and name not in referenced
            and name not in ctx.dependencies
        ):
            ctx.warnings.append(
                f"{ctx.specs[name].path}: plugin '{name}' ({plugin.type_name}) is in no scheduling "
                "profile and does nothing; reference it from a profile's plugins (pluginRef) or remove it"
            )


def _ref_field(ref: ProfilePluginSpec) -> str:
    """Error field of a profile entry; entries of the implicit default profile name their plugin."""
    return ref.path if ref.path.startswith("plugins[") else f"{ref.path}.pluginRef"


def _assemble_profile(ctx: LoadContext, prof: ProfileSpec) -> SchedulerProfile:
    """A profile: each referenced plugin goes into every slot it implements."""
    sp = SchedulerProfile(prof.name)
    for ref in prof.plugins:
        plugin = ctx.plugins[ref.plugin_ref]
        what = f"plugin '{plugin.name}' ({plugin.type_name})"
        if isinstance(plugin, Filter):
            sp.filters.append(plugin)
        if isinstance(plugin, Scorer):
            sp.scorers.append(WeightedScorer(plugin, 1.0 if ref.weight is None else ref.weight))
        elif ref.weight is not None:
            ctx.warnings.append(f"{ref.path}.weight: ignored, {what} is not a scorer")
        if isinstance(plugin, Picker):
            if sp.picker is not None:
                raise ConfigError(
                    _ref_field(ref),
                    f"failed to add plugin '{plugin.name}' to profile '{prof.name}': "
                    f"failed to set '{plugin.name}' as picker, "
                    f"already have a registered picker plugin '{sp.picker.name}'",
                )
            sp.picker = plugin
        if not isinstance(plugin, Filter | Scorer | Picker):
            # The reference silently ignores it; say so, the user probably meant something else.
            ctx.warnings.append(
                f"{_ref_field(ref)}: {what} is neither a filter, a scorer nor a picker "
                f"and is ignored in profile '{prof.name}'"
            )
    return sp
