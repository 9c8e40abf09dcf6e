"""``--watch-config-file``: a changed config file is validated and applied without a restart.

The file is polled (its size, mtime and content hash); a new content is loaded in full, as at start,
into a candidate, then compared with the running config. What may change live: the scheduling
profiles (which declared plugins they use, weights, order), the parameters of plugins that only
schedule (filters, scorers, pickers, the profile handler) and the flow-control section (bands, caps,
TTLs) while its gate, detector and band policies stay. The new scheduler is swapped in between two
requests, reusing every running plugin whose parameters did not change (their state survives). Any
other difference is refused naming what cannot change live; an invalid or refused edit keeps the
running config, is logged with its reason and sets ``llm_d_epp_config_reload_last_success`` to 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from epp import promlite
from epp.config import ConfigError, LoadedConfig
from epp.config.effective import effective_document
from epp.flowcontrol import settings_from_spec
from epp.framework.cross_replica import CrossReplicaContributor
from epp.framework.interfaces import (
    Admitter,
    DataProducer,
    DataSource,
    Decider,
    EndpointDiscovery,
    EndpointStateHolder,
    Extractor,
    FairnessPolicy,
    Filter,
    MetadataExtractor,
    OrderingPolicy,
    Parser,
    Picker,
    Plugin,
    PreRequest,
    ProfileHandler,
    ReplicatedState,
    RequestDone,
    RequestHeaderProcessor,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
    Scorer,
    Screener,
    ServingHooks,
    UsageLimitPolicy,
)
from epp.scheduling import Scheduler

log = structlog.get_logger("epp.config")

RELOADS = promlite.Counter(
    "llm_d_epp_config_reloads_total",
    "Config file changes seen by --watch-config-file, by result (applied, invalid, refused)",
    ["result"],
)
LAST_SUCCESS = promlite.Gauge(
    "llm_d_epp_config_reload_last_success",
    "1 when the last config file change was applied (or none was seen), 0 when it was not",
)

promlite.register(RELOADS, LAST_SUCCESS)

# A plugin that is one of these and none of the others only schedules: its parameters change live.
_SCHEDULING = (Filter, Scorer, Picker, ProfileHandler)
_NOT_ONLY_SCHEDULING = (
    Admitter,
    DataProducer,
    DataSource,
    Decider,
    EndpointDiscovery,
    Extractor,
    FairnessPolicy,
    OrderingPolicy,
    Parser,
    PreRequest,
    RequestDone,
    RequestHeaderProcessor,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
    Screener,
    UsageLimitPolicy,
)
_STATEFUL = (  # protocols
    CrossReplicaContributor,  # the sync loop holds its specs: a new instance would not be shared
    EndpointStateHolder,
    MetadataExtractor,
    ReplicatedState,
    ServingHooks,
)
_LIVE_SECTIONS = ("schedulingProfiles", "flowControl", "plugins")


class ReloadRefused(ConfigError):
    """A valid config that changes what cannot change while serving."""


@dataclass(slots=True)
class Reload:
    """What applying a candidate changes: the new scheduler and, with flow control, its settings."""

    scheduler: Scheduler
    plugins: dict[str, Plugin]
    flow_settings: Any = None


def _scheduling_only(plugin: Plugin) -> bool:
    """A plugin that is only a filter, scorer, picker or profile handler (no hooks, no state)."""
    return (
        isinstance(plugin, _SCHEDULING)
        and not isinstance(plugin, _NOT_ONLY_SCHEDULING)
        and not any(isinstance(plugin, p) for p in _STATEFUL)
    )


def plan_reload(running: LoadedConfig, candidate: LoadedConfig) -> Reload:
    """Check ``candidate`` against ``running``; the scheduler to swap in (ReloadRefused if it cannot)."""
    old = effective_document(running.document, running.plugins)
    new = effective_document(candidate.document, candidate.plugins)
    for key in sorted(set(old) | set(new)):
        if key not in _LIVE_SECTIONS and old.get(key) != new.get(key):
            raise ReloadRefused(key, f"{key} cannot change without a restart")
    old_plugins = {p["name"]: p for p in old["plugins"]}
    new_plugins = {p["name"]: p for p in new["plugins"]}
    added = sorted(set(new_plugins) - set(old_plugins))
    removed = sorted(set(old_plugins) - set(new_plugins))
    if added or removed:
        what = "; ".join(
            part
            for part in (f"added {added}" if added else "", f"removed {removed}" if removed else "")
            if part
        )
        raise ReloadRefused("plugins", f"plugins cannot be added or removed without a restart ({what})")
    keep: dict[str, Plugin] = {}
    for name, entry in new_plugins.items():
        plugin = running.plugins[name]
        if entry == old_plugins[name]:
            keep[name] = plugin
        elif entry["type"] != old_plugins[name]["type"]:
            raise ReloadRefused("plugins", f"plugin '{name}' cannot change its type without a restart")
        elif not _scheduling_only(plugin):
            raise ReloadRefused(
                "plugins",
                f"the parameters of plugin '{name}' (type {plugin.type_name}) cannot change without a "
                "restart: only filters, scorers, pickers and profile handlers change live",
            )
    flow_settings = None
    if old.get("flowControl") != new.get("flowControl"):
        flow_settings = _flow_settings(running, candidate, old.get("flowControl"), new.get("flowControl"))
    scheduler = candidate.scheduler
    _reuse(scheduler, keep)
    plugins = {name: keep.get(name, plugin) for name, plugin in candidate.plugins.items()}
    return Reload(scheduler, plugins, flow_settings)


def _flow_settings(running: LoadedConfig, candidate: LoadedConfig, old: Any, new: Any) -> Any:
    if running.flow_control_enabled != candidate.flow_control_enabled:
        raise ReloadRefused("featureGates", "the flowControl gate cannot change without a restart")
    if (old or {}).get("saturationDetector") != (new or {}).get("saturationDetector"):
        raise ReloadRefused(
            "flowControl.saturationDetector", "the saturation detector cannot change without a restart"
        )
    if not candidate.flow_control_enabled or candidate.document.flow_control is None:
        return None
    policies = ("fairnessPolicyRef", "orderingPolicyRef")

    def refs(section: Any) -> dict[Any, Any]:
        bands = [section.get("defaultPriorityBand") or {}, *(section.get("priorityBands") or [])]
        return {b.get("priority"): tuple(b.get(k) for k in policies) for b in bands}

    before, after = refs(old or {}), refs(new or {})
    for prio, pair in after.items():
        if prio in before and before[prio] != pair:
            raise ReloadRefused(
                "flowControl", f"the policies of priority band {prio} cannot change without a restart"
            )
    # the policy plugins are the running ones (their parameters cannot have changed)
    return settings_from_spec(candidate.document.flow_control, running.plugins)


def _reuse(scheduler: Scheduler, keep: Mapping[str, Plugin]) -> None:
    """Point the candidate scheduler at the running instances of the unchanged plugins."""

    def same(plugin: Any) -> Any:
        return keep.get(plugin.name, plugin)

    scheduler.handler = same(scheduler.handler)
    for profile in scheduler.profiles.values():
        profile.filters = [same(f) for f in profile.filters]
        for ws in profile.scorers:
            ws.scorer = same(ws.scorer)
        if profile.picker is not None:
            profile.picker = same(profile.picker)


def _fingerprint(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class ConfigWatcher:
    """Polls ``path`` every ``interval`` seconds; ``load`` makes a candidate of a text, ``apply``
    installs a planned reload (on the event loop, between requests)."""

    def __init__(
        self,
        path: str,
        running: Callable[[], LoadedConfig],
        load: Callable[[str], LoadedConfig],
        apply: Callable[[LoadedConfig, Reload], None],
        *,
        interval: float = 0.5,
    ) -> None:
        self.path = path
        self._running = running
        self._load = load
        self._apply = apply
        self.interval = interval
        self._seen = _fingerprint(path)
        self._digest = self._hash()
        LAST_SUCCESS.set(1)

    def _hash(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return hashlib.sha256(f.read()).digest()
        except OSError:
            return None

    def check(self) -> str | None:
        """Look at the file once; the result of a change (``applied``, ``invalid``, ``refused``)."""
        seen = _fingerprint(self.path)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as e:
            return self._failed("invalid", f"cannot read {self.path}: {e.strerror or e}")
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return None
        self._digest = digest
        try:
            candidate = self._load(data.decode("utf-8"))
            plan = plan_reload(self._running(), candidate)
        except ReloadRefused as e:
            return self._failed("refused", str(e))
        except (ConfigError, UnicodeDecodeError) as e:
            return self._failed("invalid", str(e))
        self._apply(candidate, plan)
        RELOADS.labels("applied").inc()
        LAST_SUCCESS.set(1)
        log.info("configuration reloaded", path=self.path, warnings=candidate.warnings or None)
        return "applied"

    def _failed(self, result: str, why: str) -> str:
        RELOADS.labels(result).inc()
        LAST_SUCCESS.set(0)
        log.error(
            "configuration change not applied; the running configuration is kept", path=self.path, reason=why
        )
        return result

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                pass
            if not stop.is_set():
                self.check()
