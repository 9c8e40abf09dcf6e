"""The plugin registry: type name -> plugin class.

Plugin classes register with ``@register`` when their module is imported; the config loader (the
composition root) imports the built-ins, and ``load_entry_points()`` imports the ``epp.plugins``
entry points of third-party packages, so a config can name their types.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TypeVar

import structlog

from epp.framework.interfaces import Plugin

log = structlog.get_logger("epp.registry")

P = TypeVar("P", bound=type[Plugin])

_REGISTRY: dict[str, type[Plugin]] = {}
_ALIASES: dict[str, str] = {}
_entry_points_loaded = False


def register(cls: P, *aliases: str) -> P:
    """Register a plugin class under its ``type_name`` (and optional deprecated aliases)."""
    if not cls.type_name:
        raise ValueError(f"{cls.__name__} has no type_name")
    _REGISTRY[cls.type_name] = cls
    for alias in aliases:
        _ALIASES[alias] = cls.type_name
    return cls


def lookup(type_name: str) -> type[Plugin] | None:
    load_entry_points()
    cls = _REGISTRY.get(type_name)
    if cls is None and type_name in _ALIASES:
        cls = _REGISTRY.get(_ALIASES[type_name])
    return cls


def registered_types() -> list[str]:
    load_entry_points()
    return sorted(_REGISTRY)


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
