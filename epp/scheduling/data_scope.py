"""Plugin data scope: which per-request data keys a filter, scorer or data producer declared it
reads (``consumes``, plus what it ``produces``) and writes (``produces``).

The framework sets ``CycleState.scope`` to the running plugin's ``DataScope`` (built once per
plugin and extension point); an access outside it is counted in
``llm_d_epp_plugin_data_scope_violations_total`` and logged once per plugin, extension point and
access kind. The counter family is registered at the first violation, so it shows only when a
plugin strays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from epp import promlite
from epp.framework import Plugin

log = structlog.get_logger("epp.data_scope")

DATA_SCOPE_VIOLATIONS = promlite.Counter(
    "llm_d_epp_plugin_data_scope_violations_total",
    "[ALPHA] Total number of per-request data accesses by a plugin outside the data keys it declares "
    "(consumes/produces), by extension point, plugin type, plugin name and access kind (read or write).",
    ["extension_point", "plugin_type", "plugin_name", "access"],
)
_registered: list[bool] = []


@dataclass(slots=True)
class DataScope:
    """One plugin at one extension point: the keys it may read and write."""

    extension_point: str
    plugin_type: str
    plugin_name: str
    reads: frozenset[str]
    writes: frozenset[str]
    _logged: set[str] = field(default_factory=set)

    def violation(self, access: str, key: str) -> None:
        if not _registered:
            _registered.append(True)
            promlite.register(DATA_SCOPE_VIOLATIONS)
        DATA_SCOPE_VIOLATIONS.labels(self.extension_point, self.plugin_type, self.plugin_name, access).inc()
        if access not in self._logged:
            self._logged.add(access)
            verb = "read" if access == "read" else "wrote"
            where = "consumes" if access == "read" else "produces"
            log.error(
                f"plugin {verb} a data key it does not declare; add it to {where}",
                plugin=f"{self.plugin_name}/{self.plugin_type}",
                extension_point=self.extension_point,
                key=key,
            )


_scopes: dict[tuple[str, int], tuple[Plugin, DataScope]] = {}


def scope_of(extension_point: str, plugin: Plugin) -> DataScope:
    """The plugin's scope at ``extension_point`` (built on first use from its declarations)."""
    entry = _scopes.get((extension_point, id(plugin)))
    if entry is not None and entry[0] is plugin:
        return entry[1]
    produces = frozenset(getattr(plugin, "produces", ()))
    scope = DataScope(
        extension_point,
        plugin.type_name,
        plugin.name,
        reads=frozenset(getattr(plugin, "consumes", ())) | produces,
        writes=produces,
    )
    _scopes[(extension_point, id(plugin))] = (plugin, scope)
    return scope
