"""What router v0.11 removed: kept loading here with one warning naming the replacement, or refused
as v0.11 refuses it when the load asks for ``--compat-version v0.11``.

``precise-prefix-cache-scorer`` is rewritten before the plugins are created into its v0.11 form, a
``precise-prefix-cache-producer`` (given the legacy parameters) read by a ``prefix-cache-scorer`` of
the same name, so the effective configuration shows what to write instead. The other removed types
are still registered (deprecated names); the flat ``disagg-profile-handler`` parameters are promoted
by the plugin itself. The pod label ``llm-d.ai/role: both`` stays ``prefill-decode`` (the endpoint
store warns once per endpoint); for v0.11 the role filters keep no such pod, as v0.11's do.
"""

from __future__ import annotations

from typing import Any

from epp.config.context import LoadContext
from epp.config.renamed import migrate_renamed
from epp.config.schema import PluginSpec
from epp.framework import registry
from epp.framework.errors import ConfigError
from epp.plugins.filters._roles import RoleFilter

COMPAT_V011 = "v0.11"
COMPAT_VERSIONS = ("", COMPAT_V011)  # "": the most permissive (v0.10 files keep working)

PRECISE_SCORER = "precise-prefix-cache-scorer"
PRECISE_PRODUCER = "precise-prefix-cache-producer"
PREFIX_SCORER = "prefix-cache-scorer"
DISAGG_HANDLER = "disagg-profile-handler"

# Removed type -> what replaces it in v0.11.
REMOVED_TYPES: dict[str, str] = {
    PRECISE_SCORER: f"'{PRECISE_PRODUCER}' plus '{PREFIX_SCORER}' with prefixMatchInfoProducerName",
    "tokenizer": "'token-producer'",
    "by-label": "'label-selector-filter'",
    "by-label-selector": "'label-selector-filter'",
    "disagg-headers-handler": "'disagg-profile-handler'",
    "prefill-header-handler": "'disagg-profile-handler'",
    "pd-profile-handler": "'disagg-profile-handler'",
}
# The flat disagg-profile-handler parameters -> their nested v0.11 place.
REMOVED_DISAGG_PARAMETERS: dict[str, str] = {
    "decodeProfile": "profiles.decode",
    "prefillProfile": "profiles.prefill",
    "encodeProfile": "profiles.encode",
    "deciderPluginName": "deciders.prefill",
    "prefillDeciderPluginName": "deciders.prefill",
    "encodeDeciderPluginName": "deciders.encode",
}


def check_removed(ctx: LoadContext, compat_version: str) -> None:
    """Refuse (``v0.11``) or migrate with a warning what v0.11 removed; before plugins are created."""
    strict = compat_version == COMPAT_V011
    migrate_renamed(ctx, strict)
    for spec in list(ctx.doc.plugins):
        try:
            if spec.type in REMOVED_TYPES and strict:
                raise ConfigError(
                    f"{spec.path}.type",
                    f"plugin type '{spec.type}' is not registered (removed in router v0.11.0; use "
                    f"{REMOVED_TYPES[spec.type]})",
                )
            if spec.type == DISAGG_HANDLER:
                _check_flat_parameters(ctx, spec, strict)
        except ConfigError as e:
            ctx.report(e)  # the plugin is left out; references to it are not reported again
            ctx.failed[spec.name] = registry.lookup(spec.type)
    for spec in [s for s in ctx.doc.plugins if s.type == PRECISE_SCORER]:
        _migrate_precise_scorer(ctx, spec)


def apply_removed_roles(ctx: LoadContext, compat_version: str) -> None:
    """For v0.11, role filters treat the removed role ``both`` as unknown; after plugins exist."""
    if compat_version != COMPAT_V011:
        return
    for plugin in ctx.plugins.values():
        if isinstance(plugin, RoleFilter):
            plugin.drop_removed_roles()


def _check_flat_parameters(ctx: LoadContext, spec: PluginSpec, strict: bool) -> None:
    flat = [k for k in (spec.parameters or {}) if k in REMOVED_DISAGG_PARAMETERS]
    if not flat:
        return
    moves = ", ".join(f"{k} -> {REMOVED_DISAGG_PARAMETERS[k]}" for k in flat)
    if strict:
        raise ConfigError(
            f"{spec.path}.parameters.{flat[0]}",
            f'unknown field "{flat[0]}" (the flat parameters were removed in router v0.11.0: {moves})',
        )
    ctx.warnings.append(
        f"{spec.path}.parameters: the flat disagg-profile-handler parameters are deprecated (removed in "
        f"router v0.11.0); use the nested form: {moves}"
    )


def _migrate_precise_scorer(ctx: LoadContext, spec: PluginSpec) -> None:
    """``precise-prefix-cache-scorer`` N -> a ``prefix-cache-scorer`` N reading a precise producer.

    With a ``precise-prefix-cache-producer`` already declared, N reads it and its own parameters are
    ignored (as the reference's wrapper did); otherwise a producer is declared right before N with
    N's parameters, and data-layer references to N (it was an endpoint extractor) move to it.
    """
    doc = ctx.doc
    producers = [s for s in doc.plugins if s.type == PRECISE_PRODUCER]
    if len(producers) > 1:
        raise ConfigError(
            f"{spec.path}.type",
            f"{PRECISE_SCORER} '{spec.name}' cannot choose between the {PRECISE_PRODUCER} plugins "
            f"{', '.join(repr(p.name) for p in producers)}: use {PREFIX_SCORER} with "
            "prefixMatchInfoProducerName instead",
        )
    replacement = REMOVED_TYPES[PRECISE_SCORER]
    if producers:
        producer = producers[0]
        ignored = " (its parameters are ignored)" if spec.parameters else ""
        ctx.warnings.append(
            f"{spec.path}.type: plugin type '{PRECISE_SCORER}' is deprecated (removed in router v0.11.0); "
            f"loaded as {PREFIX_SCORER} reading {PRECISE_PRODUCER} '{producer.name}'{ignored}; use "
            f"{replacement}"
        )
    else:
        taken = {s.name for s in doc.plugins}
        name = PRECISE_PRODUCER if PRECISE_PRODUCER not in taken else f"{spec.name}-producer"
        producer = PluginSpec(type=PRECISE_PRODUCER, name=name, parameters=spec.parameters, path=spec.path)
        doc.plugins.insert(doc.plugins.index(spec), producer)  # its path: where its parameters are
        for source in doc.data_layer.sources:
            for extractor in source.extractors:
                if extractor.plugin_ref == spec.name:
                    extractor.plugin_ref = name
        ctx.warnings.append(
            f"{spec.path}.type: plugin type '{PRECISE_SCORER}' is deprecated (removed in router v0.11.0); "
            f"loaded as {PRECISE_PRODUCER} '{name}' (its parameters) and {PREFIX_SCORER} '{spec.name}'; "
            f"use {replacement}"
        )
    spec.type = PREFIX_SCORER
    spec.parameters = _scorer_parameters(producer.name)


def _scorer_parameters(producer: str) -> dict[str, Any]:
    return {"prefixMatchInfoProducerName": producer}
