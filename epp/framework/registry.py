"""The plugin registry: type name -> plugin class (built-ins and ``epp.plugins`` entry points).

Besides the classes it records deprecated type names (aliases of a current type, or whole types
kept for old configurations) with the type that replaces them, and suggests the closest
registered name for a misspelt one.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TypeVar

import structlog

from epp.framework.interfaces import Plugin

log = structlog.get_logger("epp.registry")

P = TypeVar("P", bound=type[Plugin])


@dataclass(slots=True, frozen=True)
class Deprecation:
    """A deprecated type name: what replaces it and, when known, the versions."""

    replacement: str
    since: str = ""
    removal: str = ""

    def message(self, type_name: str) -> str:
        when = f" since {self.since}" if self.since else ""
        until = f" (removed in router {self.removal})" if self.removal else ""
        return f"plugin type '{type_name}' is deprecated{when}{until}; use '{self.replacement}' instead"


_REGISTRY: dict[str, type[Plugin]] = {}
_ALIASES: dict[str, str] = {}
_DEPRECATED: dict[str, Deprecation] = {}
_WARNED: set[str] = set()
_entry_points_loaded = False


def register(cls: P, *aliases: str) -> P:
    """Register a plugin class under its ``type_name`` and optional deprecated aliases.

    An alias loads the same class; it is recorded as deprecated in favour of ``type_name`` unless
    ``deprecate`` already gave it more detail.
    """
    if not cls.type_name:
        raise ValueError(f"{cls.__name__} has no type_name")
    _REGISTRY[cls.type_name] = cls
    for alias in aliases:
        _ALIASES[alias] = cls.type_name
        _DEPRECATED.setdefault(alias, Deprecation(cls.type_name))
    return cls


def deprecate(type_name: str, replacement: str, *, since: str = "", removal: str = "") -> None:
    """Record ``type_name`` (an alias or a registered type of its own) as deprecated."""
    _DEPRECATED[type_name] = Deprecation(replacement, since, removal)


def lookup(type_name: str) -> type[Plugin] | None:
    load_entry_points()
    cls = _REGISTRY.get(type_name)
    if cls is None and type_name in _ALIASES:
        cls = _REGISTRY.get(_ALIASES[type_name])
    return cls


def deprecation(type_name: str) -> Deprecation | None:
    """What replaces a deprecated type name, or None when it is current."""
    return _DEPRECATED.get(type_name)


def deprecation_warning_once(type_name: str) -> str | None:
    """The deprecation message of ``type_name`` the first time it is asked for in this process."""
    dep = _DEPRECATED.get(type_name)
    if dep is None or type_name in _WARNED:
        return None
    _WARNED.add(type_name)
    return dep.message(type_name)


def deprecated_names_of(type_name: str) -> list[str]:
    """The deprecated names that are replaced by ``type_name`` (aliases and legacy types), sorted."""
    return sorted(name for name, dep in _DEPRECATED.items() if dep.replacement == type_name)


def registered_types() -> list[str]:
    load_entry_points()
    return sorted(_REGISTRY)


def aliases() -> dict[str, str]:
    """Alias -> the type name it loads."""
    load_entry_points()
    return dict(_ALIASES)


def closest(name: str, candidates: list[str], cutoff: float = 0.8) -> str | None:
    """The candidate most similar to ``name`` (difflib), if any is close enough to be a typo."""
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def suggest(type_name: str) -> str | None:
    """The registered type (or alias) closest to an unknown ``type_name``; type names share many
    words (``-scorer``, ``-data-source``), so only a near miss counts."""
    load_entry_points()
    return closest(type_name, [*_REGISTRY, *_ALIASES], cutoff=0.85)


def load_entry_points(*, reload: bool = False) -> None:
    """Import every ``epp.plugins`` entry point (once, unless ``reload``).

    An entry point may name a plugin class (registered here under its ``type_name``) or a module
    whose classes register themselves with ``@register``.
    """
    global _entry_points_loaded
    if _entry_points_loaded and not reload:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="epp.plugins"):
        try:
            obj = ep.load()
        except Exception as e:  # a broken third-party package must not take the EPP down
            log.warning("cannot load plugin entry point", entry_point=ep.name, value=ep.value, error=str(e))
            continue
        if isinstance(obj, type) and issubclass(obj, Plugin) and obj.type_name not in _REGISTRY:
            register(obj)
