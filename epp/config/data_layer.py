"""The data layer: the default metrics source and extractor, data sources, endpoint discovery.

``peerDiscovery`` and ``crossReplicaSyncerPluginRef`` must name declared plugins but have no effect:
epp's standbys mirror the leader over their own replication stream (``--ha-replication-*``).
"""

from __future__ import annotations

from epp.config import defaults as d
from epp.config.context import LoadContext
from epp.config.schema import DataSourceSpec, RefSpec
from epp.framework import registry
from epp.framework.errors import ConfigError
from epp.framework.interfaces import DataSource, EndpointDiscovery, Extractor


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


def build_data_layer(ctx: LoadContext) -> list[tuple[DataSource, list[Extractor]]]:
    """Each configured data source with its extractors."""
    out: list[tuple[DataSource, list[Extractor]]] = []
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
            if not isinstance(extractor, Extractor):
                # The reference prints the source name here; naming the extractor helps more.
                raise ConfigError(ewhere, f"the plugin {ext.plugin_ref} is not a fwkdl.ExtractorBase")
            extractors.append(extractor)
        out.append((source, extractors))
    return out


def check_cross_replica(ctx: LoadContext) -> None:
    """``peerDiscovery``, ``crossReplicaSyncerPluginRef`` and ``crossReplicaSyncInterval``: checked,
    then ignored with a warning (there is no such plugin in this build)."""
    dl = ctx.doc.data_layer
    ignored: list[str] = []
    if dl.peer_discovery is not None:
        ctx.lookup_ref(dl.peer_discovery.plugin_ref, "dataLayer.peerDiscovery.pluginRef", "peer discovery")
        ignored.append("dataLayer.peerDiscovery")
    if dl.cross_replica_syncer_plugin_ref is not None:
        ctx.lookup_ref(
            dl.cross_replica_syncer_plugin_ref,
            "dataLayer.crossReplicaSyncerPluginRef",
            "cross-replica syncer",
        )
        ignored.append("dataLayer.crossReplicaSyncerPluginRef")
    interval = dl.cross_replica_sync_interval
    if interval is not None:
        if interval.seconds < 0:
            raise ConfigError(
                "dataLayer.crossReplicaSyncInterval",
                f"crossReplicaSyncInterval cannot be negative, but got {interval.text}",
            )
        ignored.append("dataLayer.crossReplicaSyncInterval")
    if ignored:
        ctx.warnings.append(
            f"{', '.join(ignored)}: no effect in epp, which has no peer discovery or cross-replica "
            "syncer plugins; with --ha-enable-leader-election standbys mirror the leader's prefix index "
            "over --ha-replication-port instead"
        )


def resolve_discovery(ctx: LoadContext) -> EndpointDiscovery | None:
    """The ``dataLayer.discovery`` plugin, if any."""
    ref = ctx.doc.data_layer.discovery
    if ref is None:
        return None
    where = f"{ref.path}.pluginRef"
    if not ref.plugin_ref:
        raise ConfigError(where, "discovery plugin reference is empty")
    plugin = ctx.plugins.get(ref.plugin_ref)
    if plugin is None:
        raise ConfigError(
            where, f'no plugin found with name "{ref.plugin_ref}"{ctx.did_you_mean(ref.plugin_ref)}'
        )
    if not isinstance(plugin, EndpointDiscovery):
        raise ConfigError(where, f'plugin "{ref.plugin_ref}" does not implement EndpointDiscovery')
    return plugin


def _is_metrics_source(ctx: LoadContext, src: DataSourceSpec) -> bool:
    # The reference checks the source name only; a renamed metrics-data-source instance counts too.
    plugin = ctx.plugins.get(src.plugin_ref)
    return src.plugin_ref == d.METRICS_DATA_SOURCE or (
        plugin is not None and plugin.type_name == d.METRICS_DATA_SOURCE
    )
