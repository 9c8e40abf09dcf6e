"""The data layer: the default metrics source and extractor, data sources, endpoint discovery,
and the cross-replica syncer (``crossReplicaSyncerPluginRef``) with its cadence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from epp.config import defaults as d
from epp.config.context import LoadContext
from epp.config.schema import DataSourceSpec, RefSpec
from epp.framework import registry
from epp.framework.cross_replica import CrossReplicaSyncer
from epp.framework.endpoint_attributes import MODELS_KEY
from epp.framework.errors import ConfigError
from epp.framework.interfaces import (
    AttributeExtractor,
    DataSource,
    EndpointDiscovery,
    EndpointExtractor,
    EndpointSource,
    Extractor,
    LoadExtractor,
    MetricsExtractor,
    NotificationExtractor,
    NotificationSource,
    PushSource,
)


def apply_data_layer_defaults(ctx: LoadContext) -> None:
    """Add ``metrics-data-source`` with ``core-metrics-extractor`` unless a metrics source is configured."""
    dl = ctx.doc.data_layer
    if not dl.inject_defaults or any(_is_metrics_source(ctx, s) for s in dl.sources):
        return
    if d.METRICS_DATA_SOURCE not in ctx.plugins and registry.lookup(d.METRICS_DATA_SOURCE) is None:
        return  # not in this build yet
    if d.METRICS_DATA_SOURCE not in ctx.plugins:
        ctx.add_default(d.METRICS_DATA_SOURCE, "data layer")
    path = f"dataLayer.sources[{len(dl.sources)}]"
    source = DataSourceSpec(d.METRICS_DATA_SOURCE, [], path)
    extractor = d.CORE_METRICS_EXTRACTOR
    if extractor in ctx.plugins or registry.lookup(extractor) is not None:
        if extractor not in ctx.plugins:
            ctx.add_default(extractor, "data layer")
        source.extractors.append(RefSpec(extractor, f"{path}.extractors[0]"))
    dl.sources.append(source)


def add_models_source(ctx: LoadContext) -> None:
    """A plugin consuming the endpoints' ``/v1/models`` lists (``models-responder``) gets a
    ``models-data-source`` with ``models-data-extractor`` when no configured source has one; a
    declared ``models-data-source`` instance is used (its TLS settings win)."""
    consumers = [p for p in ctx.plugins.values() if MODELS_KEY in getattr(p, "consumes", ())]
    if not consumers:
        return
    dl = ctx.doc.data_layer
    for src in dl.sources:
        plugin = ctx.plugins.get(src.plugin_ref)
        if plugin is not None and plugin.type_name == d.MODELS_DATA_SOURCE:
            return
    source_name = next((n for n, p in ctx.plugins.items() if p.type_name == d.MODELS_DATA_SOURCE), None)
    if source_name is None:
        source_name = ctx.add_default(d.MODELS_DATA_SOURCE, f"{consumers[0].type_name} data layer").name
    extractor = next((n for n, p in ctx.plugins.items() if p.type_name == d.MODELS_DATA_EXTRACTOR), None)
    if extractor is None:
        extractor = ctx.add_default(d.MODELS_DATA_EXTRACTOR, f"{consumers[0].type_name} data layer").name
    path = f"dataLayer.sources[{len(dl.sources)}]"
    dl.sources.append(DataSourceSpec(source_name, [RefSpec(extractor, f"{path}.extractors[0]")], path))


def build_data_layer(ctx: LoadContext) -> list[tuple[DataSource, list[Extractor]]]:
    """Each configured data source with its extractors."""
    out: list[tuple[DataSource, list[Extractor]]] = []
    gvks: dict[str, str] = {}
    dl = ctx.doc.data_layer
    for src in dl.sources:
        where = f"{src.path}.pluginRef"
        source = ctx.lookup_ref(src.plugin_ref, where, "data source")
        if not isinstance(source, DataSource):
            raise ConfigError(where, f"the plugin {src.plugin_ref} is not a fwkdl.DataSource")
        extractors: list[Extractor] = []
        for ext in src.extractors:
            ewhere = f"{ext.path}.pluginRef"
            extractor = ctx.lookup_ref(ext.plugin_ref, ewhere, "extractor")
            # An event source's extractor may be another kind of plugin taking its events (a data
            # producer dropping state of removed endpoints, as the reference's producers do).
            takes_events = (
                isinstance(source, EndpointSource) and isinstance(extractor, EndpointExtractor)
            ) or (isinstance(source, NotificationSource) and isinstance(extractor, NotificationExtractor))
            if not isinstance(extractor, Extractor) and not takes_events:
                # The reference prints the source name here; naming the extractor helps more.
                raise ConfigError(ewhere, f"the plugin {ext.plugin_ref} is not a fwkdl.ExtractorBase")
            _check_pair(source, cast(Extractor, extractor), extractors, ewhere)
            extractors.append(cast(Extractor, extractor))
        if isinstance(source, NotificationSource):
            gvk = str(source.gvk)
            if gvk in gvks:
                raise ConfigError(
                    where,
                    f"duplicate notification source GVK {gvk}: already used by source {gvks[gvk]}, "
                    f"cannot add {source.typed_name}",
                )
            gvks[gvk] = source.name
        out.append((source, extractors))
    return out


@dataclass(slots=True, frozen=True)
class CrossReplicaSettings:
    """The syncer replicas share routing state through, and its cadence (seconds)."""

    syncer: CrossReplicaSyncer
    interval: float
    publish_timeout: float | None


def check_cross_replica(ctx: LoadContext) -> CrossReplicaSettings | None:
    """``crossReplicaSyncerPluginRef`` (a ``CrossReplicaSyncer``), ``crossReplicaSyncInterval``,
    the publish timeout and ``peerDiscovery`` (the syncer's own peer store, or a warning)."""
    dl = ctx.doc.data_layer
    for field, name in (
        (dl.cross_replica_sync_interval, "crossReplicaSyncInterval"),
        (dl.cross_replica_publish_timeout, "crossReplicaPublishTimeout"),
    ):
        if field is not None and field.seconds < 0:
            raise ConfigError(f"dataLayer.{name}", f"{name} cannot be negative, but got {field.text}")
    syncer: CrossReplicaSyncer | None = None
    if dl.cross_replica_syncer_plugin_ref is not None:
        where = "dataLayer.crossReplicaSyncerPluginRef"
        plugin = ctx.lookup_ref(dl.cross_replica_syncer_plugin_ref, where, "cross-replica syncer")
        if not isinstance(plugin, CrossReplicaSyncer):
            raise ConfigError(
                where, f"the plugin {dl.cross_replica_syncer_plugin_ref} is not a CrossReplicaSyncer"
            )
        syncer = plugin
    if dl.peer_discovery is not None:
        peers = ctx.lookup_ref(
            dl.peer_discovery.plugin_ref, "dataLayer.peerDiscovery.pluginRef", "peer discovery"
        )
        if peers is not syncer:
            ctx.warnings.append(
                "dataLayer.peerDiscovery: no effect in epp unless it names the cross-replica syncer, "
                "whose replica registry is the peer store"
            )
    if syncer is None:
        if dl.cross_replica_sync_interval is not None or dl.cross_replica_publish_timeout is not None:
            ctx.warnings.append(
                "dataLayer.crossReplicaSyncInterval: no effect without crossReplicaSyncerPluginRef"
            )
        return None
    interval = dl.cross_replica_sync_interval
    timeout = dl.cross_replica_publish_timeout
    return CrossReplicaSettings(
        syncer,
        interval.seconds if interval is not None and interval.seconds > 0 else d.CROSS_REPLICA_SYNC_INTERVAL,
        timeout.seconds if timeout is not None and timeout.seconds > 0 else None,
    )


def _check_pair(source: DataSource, extractor: Extractor, earlier: list[Extractor], where: str) -> None:
    """Reject an extractor its source cannot feed, or a second one of the same type."""
    if any(e.type_name == extractor.type_name for e in earlier):
        raise ConfigError(
            where,
            f"duplicate extractor type configured for the same source: source={source.typed_name}, "
            f"extractor type={extractor.type_name}",
        )
    if isinstance(source, EndpointSource):
        if not isinstance(extractor, EndpointExtractor):
            raise ConfigError(
                where,
                f"endpoint source {source.typed_name} requires an EndpointExtractor; "
                f"extractor {extractor.typed_name} does not implement it",
            )
        return
    if isinstance(source, NotificationSource):
        if not isinstance(extractor, NotificationExtractor):
            raise ConfigError(
                where,
                f"notification source {source.typed_name} requires a NotificationExtractor; "
                f"extractor {extractor.typed_name} does not implement it",
            )
        if str(extractor.gvk) != str(source.gvk):
            raise ConfigError(
                where,
                f"extractor {extractor.typed_name} GVK {extractor.gvk} does not match source "
                f"{source.typed_name} GVK {source.gvk}",
            )
        return
    if isinstance(source, PushSource):
        if not isinstance(extractor, LoadExtractor):
            raise ConfigError(
                where,
                f"push source {source.typed_name} requires a load extractor (zmq-state-extractor); "
                f"extractor {extractor.typed_name} does not implement it",
            )
        return
    if isinstance(extractor, LoadExtractor):
        raise ConfigError(
            where,
            f"extractor {extractor.typed_name} decodes pushed load: it needs a push source "
            f"(zmq-metrics-data-source), not {source.typed_name}",
        )
    # An extractor implementing none of the extraction contracts is left to the data layer (which
    # skips it with a warning): third-party types may be config-only placeholders.
    polled = isinstance(extractor, MetricsExtractor | AttributeExtractor)
    if polled and extractor.accepts != source.payload:
        raise ConfigError(
            where,
            f"dispatcher {source.typed_name} rejected extractor {extractor.typed_name}: "
            f"extractor type mismatch (the source yields {source.payload!r}, the extractor reads "
            f"{extractor.accepts!r})",
        )


def resolve_discovery(ctx: LoadContext) -> EndpointDiscovery | None:
    """The ``dataLayer.discovery`` plugin, if any."""
    ref = ctx.doc.data_layer.discovery
    if ref is None:
        return None
    where = f"{ref.path}.pluginRef"
    if not ref.plugin_ref:
        raise ConfigError(where, "discovery plugin reference is empty")
    plugin = ctx.get(ref.plugin_ref)
    if plugin is None:
        raise ConfigError(
            where, f'no plugin found with name "{ref.plugin_ref}"{ctx.did_you_mean(ref.plugin_ref)}'
        )
    if not isinstance(plugin, EndpointDiscovery):
        raise ConfigError(where, f'plugin "{ref.plugin_ref}" does not implement EndpointDiscovery')
    return plugin


def warn_unused_data_sources(ctx: LoadContext) -> None:
    """Warn about a data source no ``dataLayer.sources`` entry names: it is created and never runs."""
    used = {src.plugin_ref for src in ctx.doc.data_layer.sources}
    for name, plugin in ctx.plugins.items():
        if isinstance(plugin, DataSource) and name not in used and name not in ctx.dependencies:
            ctx.warnings.append(
                f"{ctx.specs[name].path}: plugin '{name}' ({plugin.type_name}) is in no dataLayer.sources "
                "entry and never runs; add `{pluginRef: " + name + ", extractors: [...]}` there or remove it"
            )


def _is_metrics_source(ctx: LoadContext, src: DataSourceSpec) -> bool:
    # The reference checks the source name only; a renamed metrics-data-source instance counts too.
    plugin = ctx.plugins.get(src.plugin_ref)
    return src.plugin_ref == d.METRICS_DATA_SOURCE or (
        plugin is not None and plugin.type_name == d.METRICS_DATA_SOURCE
    )
