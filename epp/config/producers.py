"""Data producers: auto-creating one for a data key consumed but not produced, and their run order.

A plugin declares the keys it reads in an optional ``consumes`` attribute; ``d.AUTO_PRODUCERS`` maps
a key to the producer type created for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from epp.config import defaults as d
from epp.config.context import LoadContext
from epp.framework import registry
from epp.framework.errors import ConfigError
from epp.framework.interfaces import DataProducer, Plugin
from epp.framework.params import yaml_key


def create_missing_producers(ctx: LoadContext) -> None:
    """Create the producer of each consumed key no plugin produces (when it is registered)."""
    produced: set[str] = set()
    for p in ctx.plugins.values():
        produced |= _produces(p)
    consumers: dict[str, list[str]] = {}
    for name, p in ctx.plugins.items():
        for key in sorted(_consumes(p) - produced):
            consumers.setdefault(key, []).append(name)
    for key, names in consumers.items():
        type_name = d.AUTO_PRODUCERS.get(key)
        if type_name is None or key in produced:
            continue  # metric keys have no producer; or produced by a producer created above
        if any(p.type_name == type_name for p in ctx.plugins.values()):
            continue
        cls = registry.lookup(type_name)
        if cls is None:
            ctx.warnings.append(
                f"plugin '{names[0]}' consumes {key}, which no plugin produces, and the producer "
                f"type '{type_name}' is not registered in this build"
            )
            continue
        plugin = ctx.add_default(type_name, "data producer", _forwarded_params(ctx, cls, names) or None)
        produced |= _produces(plugin) | {k for k, t in d.AUTO_PRODUCERS.items() if t == type_name}


def ordered_producers(ctx: LoadContext) -> list[DataProducer]:
    """Producers in ``plugins:`` order, except that a producer runs after those it consumes from."""
    producers = [p for p in ctx.plugins.values() if isinstance(p, DataProducer)]
    deps = {
        p.name: {q.name for q in producers if q is not p and _consumes(p) & q.produces} for p in producers
    }
    ordered: list[DataProducer] = []
    placed: set[str] = set()
    pending = list(producers)
    while pending:
        ready = next((p for p in pending if deps[p.name] <= placed), None)
        if ready is None:
            raise ConfigError(ctx.specs[pending[0].name].path, "cycle detected: graph is not a DAG")
        pending.remove(ready)
        ordered.append(ready)
        placed.add(ready.name)
    return ordered


def _consumes(plugin: Plugin) -> frozenset[str]:
    """Data keys a plugin consumes: its optional ``consumes`` class attribute (not in the contract)."""
    keys = getattr(plugin, "consumes", None)
    if isinstance(keys, str) or not isinstance(keys, Iterable):
        return frozenset()
    return frozenset(k for k in keys if isinstance(k, str))


def _produces(plugin: Plugin) -> frozenset[str]:
    return plugin.produces if isinstance(plugin, DataProducer) else frozenset()


def _forwarded_params(ctx: LoadContext, cls: type[Plugin], consumers: list[str]) -> dict[str, Any]:
    """Parameters given to a consumer that the auto-created producer understands.

    The reference ignores ``prefix-cache-scorer``'s ``blockSizeTokens`` etc.; users expect them to
    take effect, so they are forwarded to the producer it creates (the first consumer wins).
    """
    if not dataclasses.is_dataclass(cls.Params):
        return {}
    known = {yaml_key(f) for f in dataclasses.fields(cls.Params)}
    out: dict[str, Any] = {}
    for name in consumers:
        spec = ctx.specs[name]
        for key, value in (spec.parameters or {}).items():
            if key not in known:
                continue
            if key in out and out[key] != value:
                ctx.warnings.append(
                    f"{spec.path}.parameters.{key}: conflicts with another consumer of "
                    f"'{cls.type_name}'; using {out[key]!r}"
                )
                continue
            out[key] = value
    return out
