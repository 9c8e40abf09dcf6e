"""The catalog of registered plugin types (``epp plugins``): kinds, stability, aliases, deprecated
names (aliases and legacy types this type replaces) and parameters with their defaults, as text or
as JSON-ready data."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

import epp.plugins  # noqa: F401 - registers the built-in plugin types
from epp.config.effective import yaml_safe
from epp.framework import registry
from epp.framework.interfaces import (
    Admitter,
    DataProducer,
    DataSource,
    EndpointDiscovery,
    Extractor,
    FairnessPolicy,
    Filter,
    OrderingPolicy,
    Parser,
    Picker,
    Plugin,
    PreRequest,
    ProfileHandler,
    RequestDone,
    RequestHeaderProcessor,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
    Scorer,
    Screener,
    SupportsDisaggregate,
    UsageLimitPolicy,
)
from epp.framework.params import yaml_key

_KINDS: tuple[tuple[Any, str], ...] = (
    (ProfileHandler, "profile-handler"),
    (Filter, "filter"),
    (Scorer, "scorer"),
    (Picker, "picker"),
    (SupportsDisaggregate, "decider"),
    (DataProducer, "data-producer"),
    (RequestHeaderProcessor, "request-header"),
    (Screener, "screener"),
    (Admitter, "admitter"),
    (PreRequest, "pre-request"),
    (ResponseHeaderProcessor, "response-header"),
    (ResponseBodyProcessor, "response-body"),
    (RequestDone, "request-done"),
    (SaturationDetector, "saturation-detector"),
    (Parser, "parser"),
    (EndpointDiscovery, "discovery"),
    (DataSource, "data-source"),
    (Extractor, "extractor"),
    (OrderingPolicy, "ordering-policy"),
    (FairnessPolicy, "fairness-policy"),
    (UsageLimitPolicy, "usage-limit-policy"),
)

REQUIRED = "(required)"
_QUALIFIED = re.compile(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")  # module.path.Name -> Name


def kinds_of(cls: type[Plugin]) -> list[str]:
    """The extension points a plugin class fills, e.g. ``["filter", "saturation-detector"]``."""
    return [name for kind, name in _KINDS if isinstance(cls, type) and issubclass(cls, kind)]


def parameters_of(params_cls: type) -> dict[str, Any]:
    """YAML key -> default value of a Params dataclass (``REQUIRED`` when it has none)."""
    if not dataclasses.is_dataclass(params_cls):
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params_cls):
        if f.default is not dataclasses.MISSING:
            value: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = REQUIRED
        out[yaml_key(f)] = yaml_safe(value)
    return out


def _hint_names(params_cls: type) -> dict[str, str]:
    """YAML key -> the field's type as written (for the text listing)."""
    try:
        hints = typing.get_type_hints(params_cls)
    except Exception:  # an unresolvable annotation must not break the listing
        hints = {}
    out = {}
    for f in dataclasses.fields(params_cls) if dataclasses.is_dataclass(params_cls) else ():
        hint = hints.get(f.name, f.type)
        plain = typing.get_origin(hint) is None and hasattr(hint, "__name__")
        out[yaml_key(f)] = hint.__name__ if plain else _QUALIFIED.sub(r"\1", str(hint))
    return out


def describe() -> list[dict[str, Any]]:
    """Every registered type, sorted by name, with what ``epp plugins`` shows."""
    out = []
    aliases = registry.aliases()
    for type_name in registry.registered_types():
        cls = registry.lookup(type_name)
        assert cls is not None
        entry: dict[str, Any] = {
            "type": type_name,
            "kinds": kinds_of(cls),
            "stability": cls.stability.value,
            "aliases": sorted(a for a, target in aliases.items() if target == type_name),
            "deprecatedNames": registry.deprecated_names_of(type_name),
            "parameters": parameters_of(cls.Params),
        }
        dep = registry.deprecation(type_name)
        if dep is not None:
            entry["deprecated"] = {"replacement": dep.replacement, "since": dep.since, "removal": dep.removal}
        out.append(entry)
    return out


def render_text() -> str:
    """A human-readable listing: one block per type."""
    lines: list[str] = []
    for entry in describe():
        cls = registry.lookup(entry["type"])
        hints = _hint_names(cls.Params) if cls is not None else {}
        head = f"{entry['type']}  [{', '.join(entry['kinds']) or 'other'}]  {entry['stability']}"
        if entry["stability"] == "alpha":
            head += " (needs --allow-experimental-plugins)"
        lines.append(head)
        dep = entry.get("deprecated")
        if dep:
            when = "".join(
                (
                    f" since {dep['since']}" if dep["since"] else "",
                    f", removal {dep['removal']}" if dep["removal"] else "",
                )
            )
            lines.append(f"  deprecated{when}: use {dep['replacement']}")
        if entry["aliases"]:
            lines.append(f"  aliases (same type): {', '.join(entry['aliases'])}")
        if entry["deprecatedNames"]:
            lines.append(f"  deprecated names: {', '.join(entry['deprecatedNames'])}")
        for key, default in entry["parameters"].items():
            shown = default if default == REQUIRED else _yaml_scalar(default)
            lines.append(f"  {key}: {hints.get(key, '')} = {shown}")
    return "\n".join(lines) + "\n"


def _yaml_scalar(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=False)
