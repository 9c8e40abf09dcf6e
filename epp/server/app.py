"""``epp serve``: wire the configuration, the data layer and the gRPC servers together."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from epp import logs, metrics, promlite, tracing
from epp.config import LoadedConfig
from epp.datalayer.cross_replica import CrossReplicaRuntime
from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.pool_gauges import PoolGauges
from epp.datalayer.runtime import DataLayer
from epp.datalayer.scrape_loop import ScrapeLoop
from epp.datalayer.served_models import ServedModels
from epp.datalayer.store import EndpointStore
from epp.flowcontrol import FlowController, settings_from_spec
from epp.framework import (
    Endpoint,
    EndpointStateHolder,
    MetadataExtractor,
    ReplicatedState,
    ServingHooks,
    UpstreamFailureListener,
)
from epp.framework.cross_replica import CrossReplicaContributor
from epp.promlite import start_http_server
from epp.scheduling import Scheduler
from epp.server import h2grpc, heap, pool_metrics, status_page, upstream_failures
from epp.server.config_reload import ConfigWatcher, Reload, plan_reload
from epp.server.decisions import DecisionLog
from epp.server.director import Director, DirectorHooks
from epp.server.extproc import ExternalProcessor, StreamOptions, add_to_server
from epp.server.health import Health
from epp.server.metrics_port import MetricsPort
from epp.server.pools import Pool, PoolNotifier, PoolRegistry
from epp.server.replication import ReplicationFollower, ReplicationHub
from epp.server.tls import (
    REPLICA_NAME,
    replica_channel_credentials,
    replica_server_credentials,
    server_credentials,
    server_ssl_context,
)

if TYPE_CHECKING:
    from epp.k8s.runtime import KubeRuntime

log = structlog.get_logger("epp.serve")


@dataclass(slots=True)
class ServeOptions:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    grpc_socket: str = ""  # also serve ext_proc on this Unix socket ("" = TCP only)
    extproc_server: str = "epp"  # the ext_proc port's gRPC server: "epp" (h2grpc) or "grpcio"
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"
    secure_serving: bool = True
    cert_path: str | None = None
    client_ca_file: str | None = None
    enable_cert_reload: bool = False
    replication_port: int = 9004
    replication_cert_path: str | None = None
    health_checking: bool = False
    pool_name: str = "epp"
    pool_namespace: str = "default"
    refresh_metrics_interval: float = 0.05
    refresh_prometheus_metrics_interval: float = 5.0
    metrics_staleness_threshold: float = 2.0
    metrics_scrape_timeout: float = 0.0  # 0: the staleness threshold less one interval, at least 1 s
    disable_endpoint_subset_filter: bool = False
    max_request_body_bytes: int = 10 << 20
    max_buffered_request_body_bytes: int = 256 << 20
    request_idle_timeout: float = 60.0
    debug_response_header: bool = True
    allow_model_rewrite_header: bool = True
    grace_period: float = 5.0
    drain_delay: float = 1.0
    metrics_endpoint_auth: bool = False  # TokenReview + SubjectAccessReview per scrape (Kubernetes mode)
    emit_endpoint_scores: bool = False
    emit_deprecated_metrics: bool = True  # the deprecated metric names beside the current ones
    skip_unused_response_phases: bool = False
    grpc_stream_metrics: bool = False
    grpc_max_recv_msg_size: int = 0  # 0: max_request_body_bytes + 1 MiB
    grpc_max_send_msg_size: int = 0
    h2_limits: h2grpc.Limits = field(default_factory=h2grpc.Limits)  # --h2-* (epp's own server only)
    decision_ring_size: int = 100  # /debug/decisions keeps this many (0: none)
    decision_log_sample_rate: float = 0.01  # share of decisions logged as request.decision
    decision_metadata: bool = False  # envoy.lb epp.decision dynamic metadata in the routing reply
    decision_response_header: bool = False  # x-epp-decision on each response
    status_page: bool = True  # /status and /status.json on the metrics port


def _grpc_options(max_body: int, max_recv: int = 0, max_send: int = 0) -> list[tuple[str, int]]:
    limit = max_body + (1 << 20)  # BUFFERED mode delivers (and we may return) the body in one message
    return [
        ("grpc.so_reuseport", 0),  # a second EPP on the same port must fail, not share it
        ("grpc.max_receive_message_length", max_recv or limit),
        ("grpc.max_send_message_length", max_send or limit),
        ("grpc.max_concurrent_streams", 100_000),
        # Envoy's ext_proc cluster pings every second (a frozen EPP is detected by the missing ack);
        # gRPC's default ping policy would answer that with GOAWAY and break open streams.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _extproc_server(opts: ServeOptions) -> grpc.aio.Server | h2grpc.Server:
    """The ext_proc port's gRPC server (``--extproc-server``)."""
    if opts.extproc_server == "grpcio":
        return grpc.aio.server(
            options=_grpc_options(
                opts.max_request_body_bytes, opts.grpc_max_recv_msg_size, opts.grpc_max_send_msg_size
            )
        )
    limit = opts.max_request_body_bytes + (1 << 20)
    return h2grpc.Server(
        max_receive_message_length=opts.grpc_max_recv_msg_size or limit,
        max_send_message_length=opts.grpc_max_send_msg_size or limit,
        limits=opts.h2_limits,
    )


def _bind(server: grpc.aio.Server | h2grpc.Server, address: str, opts: ServeOptions) -> None:
    if not opts.secure_serving:
        server.add_insecure_port(address)
        return
    ca, reload = opts.client_ca_file, opts.enable_cert_reload
    if isinstance(server, h2grpc.Server):
        server.add_secure_port(address, server_ssl_context(opts.cert_path, client_ca_file=ca, reload=reload))
    else:
        server.add_secure_port(address, server_credentials(opts.cert_path, client_ca_file=ca, reload=reload))


class EppServer:
    """The running EPP; ``run()`` serves until ``stop()`` or a signal.

    Start-up: health, replication and metrics servers, the endpoint source, scraping, ext_proc.
    Shutdown: readiness off and the Lease released, ``--drain-delay``, then ext_proc drains for
    ``--grace-period`` and the data layer stops.
    """

    def __init__(
        self,
        cfg: LoadedConfig,
        opts: ServeOptions,
        store: EndpointStore | None = None,
        *,
        kube: KubeRuntime | None = None,
        objectives: ObjectiveStore | None = None,
        config_watch: tuple[str, Callable[[str], LoadedConfig]] | None = None,
        pool_config: Callable[[EndpointStore, str | None], LoadedConfig] | None = None,
    ) -> None:
        """``objectives``: priorities from ``--objectives-file`` (without Kubernetes).
        ``pool_config(store, text)``: loads the config again for another pool's store, from the
        shared config's text (``text`` None) or a text of its own (an EPP serving several pools);
        without it, the EPP serves one pool."""
        self.cfg = cfg
        self.config_watch = config_watch  # --watch-config-file: the file and how to load a candidate
        self.opts = opts
        self.store = store if store is not None else EndpointStore()  # an empty store is falsy
        self.kube = kube
        self.health = Health(leader_election=kube is not None and kube.leader is not None)
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        if opts.grpc_stream_metrics:
            metrics.enable_grpc_stream_metrics()
        self._objectives = kube.objectives if kube is not None else objectives
        self._rewrites = kube.rewrites if kube is not None else None
        self.pool_config = pool_config  # another pool's own LoadedConfig (several pools)
        self._config_text: str | None = None  # the shared config's text, once reloaded
        self._runner = ScrapeLoop()  # every pool's scrapes run on the data layer's one thread
        self._running = False
        self._background: list[asyncio.Future[None]] = []
        self._decisions: DecisionLog | None = (
            DecisionLog(opts.decision_ring_size, opts.decision_log_sample_rate) if self._decides() else None
        )
        primary = self._build_pool(opts.pool_name, cfg, self.store)
        self.pools = PoolRegistry(primary, self._new_pool if pool_config is not None else None)
        self.pools.on_added = self._pool_added
        self.pools.on_removed = self._pool_removed
        self._serving_hooks = primary.serving
        self.flow_control = primary.flow_control
        promlite.configure_exposition(  # /metrics shows the families of what is loaded
            emit_deprecated=opts.emit_deprecated_metrics, loaded=self._metric_owners(cfg)
        )
        self.director = primary.director
        self.stream_options = StreamOptions(
            max_body_bytes=opts.max_request_body_bytes,
            debug_response_header=opts.debug_response_header,
            response_header=tuple(cfg.response_header),
            response_body=tuple(cfg.response_body),
            request_idle_timeout=opts.request_idle_timeout,
            max_buffered_body_bytes=opts.max_buffered_request_body_bytes,
            emit_endpoint_scores=opts.emit_endpoint_scores,
            skip_unused_response_phases=opts.skip_unused_response_phases,
            grpc_stream_metrics=opts.grpc_stream_metrics,
            decision_metadata=opts.decision_metadata,
            decision_header=opts.decision_response_header,
        )
        self.processor = ExternalProcessor(self.director, self.stream_options, pools=self.pools)
        metrics.ENDPOINT_INFLIGHT.endpoints = self.pools.endpoints
        self.data_layer = primary.data_layer
        self.scraper = self.data_layer.metrics_scraper
        self.pool_gauges = primary.gauges
        # bounds the model_name metric labels: every pool's models keep their own label
        self.served_models = ServedModels(self.pools)

    def _build_pool(self, name: str, cfg: LoadedConfig, store: EndpointStore) -> Pool:
        """One pool's runtime from its own config: store listeners, director, data layer, gauges."""
        opts = self.opts
        holders: list[EndpointStateHolder] = [
            p for p in cfg.plugins.values() if isinstance(p, EndpointStateHolder)
        ]
        if holders:  # release per-endpoint plugin state (prefix index, counters) with the endpoint
            store.subscribe(on_remove=lambda e: _remove_endpoint_state(holders, e))
        extractors: list[MetadataExtractor] = [
            p for p in cfg.plugins.values() if isinstance(p, MetadataExtractor)
        ]
        if extractors:  # endpoint attributes derived from labels (topology)
            extract = lambda e: _extract_metadata(extractors, e)  # noqa: E731
            store.subscribe(on_add=extract, on_update=extract)
        scheduler = cfg.scheduler
        assert isinstance(scheduler, Scheduler)
        self._prepare(scheduler)
        flow_control = _flow_controller(cfg, store, name)
        director = Director(
            store,
            cfg.parsers,
            scheduler,
            DirectorHooks(
                cfg.producers,
                cfg.admitters,
                cfg.pre_request,
                cfg.request_done,
                request_header=cfg.request_header,
                screeners=cfg.screeners,
                responders=cfg.responders,
            ),
            use_subset_hint=not opts.disable_endpoint_subset_filter,
            saturation_detector=cfg.saturation_detector,
            objectives=self._objectives,
            rewrites=self._rewrites,
            client_model_rewrite=opts.allow_model_rewrite_header,
            flow_control=flow_control,
            propagate_priority=cfg.propagate_priority,
        )
        director.explain = logs.debug_enabled()
        director.pool_label = metrics.pool_label(name)
        director.decisions = self._decisions  # one ring and sampled log for every pool
        data_layer = DataLayer(
            store,
            cfg.data_sources,
            refresh_interval=opts.refresh_metrics_interval,
            staleness=opts.metrics_staleness_threshold,
            timeout=opts.metrics_scrape_timeout,
            runner=self._runner,
        )
        gauges = PoolGauges(
            store,
            pool_name=name,
            interval=opts.refresh_prometheus_metrics_interval,
            staleness=opts.metrics_staleness_threshold,
        )
        serving: list[ServingHooks] = [p for p in cfg.plugins.values() if isinstance(p, ServingHooks)]
        return Pool(name, cfg, store, director, flow_control, data_layer, gauges, serving)

    def _new_pool(self, name: str, config: str | None = None) -> Pool:
        """Another pool (several pools): the same ``EndpointPickerConfig`` (as last reloaded), or
        ``config``, a text of its own; its own plugin instances either way."""
        assert self.pool_config is not None
        store = EndpointStore()
        store.synced = True
        text = config if config is not None else self._config_text
        pool = self._build_pool(name, self.pool_config(store, text), store)
        pool.own_config = config is not None
        return pool

    def _pool_added(self, pool: Pool) -> None:
        if self._running:
            self._background.append(asyncio.ensure_future(self._start_pool(pool)))

    def _pool_removed(self, pool: Pool) -> None:
        self._background.append(asyncio.ensure_future(self._stop_pool(pool)))

    async def _start_pool(self, pool: Pool) -> None:
        if pool.started:
            return
        pool.started = True
        pool.data_layer.start()
        pool.gauges.start()
        for hook in pool.serving:
            await hook.start_serving()
        pool.cross_replica = self._cross_replica(pool)
        if pool.cross_replica is not None:
            pool.cross_replica.start()

    async def _stop_pool(self, pool: Pool) -> None:
        if not pool.started:
            return
        pool.started = False
        if pool.flow_control is not None:
            pool.flow_control.close()
        for hook in reversed(pool.serving):
            try:
                await hook.stop_serving()
            except Exception as e:
                log.error("plugin failed to stop", plugin=repr(hook), error=repr(e))
        if pool.cross_replica is not None:
            await pool.cross_replica.stop()
            pool.cross_replica = None
        await pool.data_layer.stop()
        await pool.gauges.stop()

    def _prepare(self, scheduler: Scheduler) -> None:
        scheduler.timer = metrics.observe_plugin
        for profile in scheduler.profiles.values():
            profile.timer = metrics.observe_plugin
            profile.record_scores = self.opts.emit_endpoint_scores
            profile.explain = logs.debug_enabled()
            profile.decide = self._decides()
        tracing.instrument(scheduler.profiles)  # no-op unless --tracing

    def _decides(self) -> bool:
        """Whether the profiles record their decisions: something shows them."""
        o = self.opts
        return bool(
            o.decision_ring_size
            or o.decision_log_sample_rate > 0
            or o.decision_metadata
            or o.decision_response_header
        )

    def apply_reload(self, candidate: LoadedConfig, plan: Reload, text: str | None = None) -> None:
        """Install a checked config change (``config_reload.plan_reload``) between two requests: in
        the first pool, then (``text``, the new config's text) in every other pool that takes the
        shared config, each with a candidate of its own plugin instances."""
        self._prepare(plan.scheduler)
        if plan.flow_settings is not None and self.flow_control is not None:
            self.flow_control.reconfigure(plan.flow_settings)
        self.director.scheduler = plan.scheduler
        self.cfg = dataclasses.replace(
            self.cfg, document=candidate.document, scheduler=plan.scheduler, plugins=plan.plugins
        )
        self.pools.primary.cfg = self.cfg
        promlite.configure_exposition(
            emit_deprecated=self.opts.emit_deprecated_metrics, loaded=self._metric_owners(self.cfg)
        )
        if text is None or self.pool_config is None:
            return
        self._config_text = text  # pools added from now on take it too
        for pool in list(self.pools.pools.values()):
            if pool is self.pools.primary or pool.own_config:
                continue
            try:
                self._reload_pool(pool, text)
            except Exception as e:  # checked against the first pool: not expected
                log.error("configuration reload failed for a pool", pool=pool.name, error=str(e))

    def _reload_pool(self, pool: Pool, text: str) -> None:
        assert self.pool_config is not None
        candidate = self.pool_config(pool.store, text)
        plan = plan_reload(pool.cfg, candidate)
        self._prepare(plan.scheduler)
        if plan.flow_settings is not None and pool.flow_control is not None:
            pool.flow_control.reconfigure(plan.flow_settings)
        pool.director.scheduler = plan.scheduler
        pool.cfg = dataclasses.replace(
            pool.cfg, document=candidate.document, scheduler=plan.scheduler, plugins=plan.plugins
        )

    def _metric_owners(self, cfg: LoadedConfig) -> set[str]:
        owners = _metric_owners(cfg, self.flow_control)
        if self.pool_config is not None:  # may serve several pools: the per-pool request counts
            owners.add(pool_metrics.OWNER)
        return owners

    def stop(self) -> None:
        """First call: graceful shutdown. A second call (Ctrl-C twice) skips the drain delay."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    def _cross_replica(self, pool: Pool | None = None) -> CrossReplicaRuntime | None:
        """With a syncer (``dataLayer.crossReplicaSyncerPluginRef``): replicas share routing state.
        Every pool shares its own (its own syncer instance, state keys under its own name)."""
        pool = pool if pool is not None else self.pools.primary
        settings = pool.cfg.cross_replica
        if settings is None:
            return None
        specs = [spec for c in _contributors(pool) for spec in c.cross_replica_specs()]
        specs += pool.data_layer.share_scrapes(
            settings.syncer.replica_id, settings.syncer.peers, settings.interval
        )
        log.info(
            "sharing routing state with the other replicas",
            syncer=getattr(settings.syncer, "name", ""),
            replica=settings.syncer.replica_id,
            pool=pool.name,
            states=[s.state_key for s in specs],
            interval_s=settings.interval,
        )
        namespaced = pool.name if "/" in pool.name else f"{self.opts.pool_namespace}/{pool.name}"
        return CrossReplicaRuntime(
            settings.syncer,
            specs,
            pool=namespaced,
            interval=settings.interval,
            publish_timeout=settings.publish_timeout,
        )

    def _replication(self) -> tuple[ReplicationHub, ReplicationFollower] | None:
        """With leader election: standbys mirror the leader's learned plugin state (prefix index)."""
        leader = self.kube.leader if self.kube is not None else None
        if leader is None:
            return None
        plugins = {n: p for n, p in self.cfg.plugins.items() if isinstance(p, ReplicatedState)}
        if not plugins:
            return None
        if self.cfg.cross_replica is not None:
            log.info("a cross-replica syncer shares the prefix index: no --ha-replication-port stream")
            return None
        log.warning(
            "the leader/standby replication stream (--ha-replication-port) is deprecated: configure a "
            "cross-replica syncer (redis-syncer, dataLayer.crossReplicaSyncerPluginRef), with which "
            "every replica serves and shares its routing state"
        )
        cert_path = self.opts.replication_cert_path
        if not cert_path:
            log.warning(
                "no --ha-replication-cert-path: standbys will not mirror the leader's prefix index "
                "(the replication stream is served only over mutual TLS)"
            )
            return None
        if not leader.advertise:
            log.warning("no --ha-advertise-address: standbys will not mirror the leader's prefix index")
        hub = ReplicationHub(plugins, is_leader=lambda: leader.is_leader, peer_name=REPLICA_NAME)
        follower = ReplicationFollower(
            plugins,
            lambda: None if leader.is_leader else leader.leader_address,
            credentials=lambda: replica_channel_credentials(cert_path),
            server_name=REPLICA_NAME,
        )
        return hub, follower

    def _notifier(self) -> EndpointStore | PoolNotifier:
        """Where file discovery writes: the store, or by pool when the EPP may serve several."""
        if self.pool_config is None:
            return self.store
        return PoolNotifier(self.pools, lambda problem: self.health.set_degraded("pools", problem))

    def _pool_status(self, ready: bool, reason: str) -> None:
        self.store.synced = ready
        self.health.set_condition_soon("pool", ready, reason)

    def _leadership(self, leader: bool) -> None:
        self.health.set_condition_soon("leader", leader, "" if leader else "not the leader")

    async def run(self) -> None:
        opts, cfg = self.opts, self.cfg
        metrics.INFO.labels("unknown", "epp").set(1)
        middleware = None
        if opts.metrics_endpoint_auth and self.kube is not None:
            from epp.k8s.metrics_auth import MetricsAuth

            middleware = MetricsAuth(self.kube.api, asyncio.get_running_loop()).wrap
        status = (lambda: status_page.collect(self)) if opts.status_page else None
        port = MetricsPort(self.health, lambda: self.director.decisions, status=status, protect=middleware)
        start_http_server(opts.metrics_port, addr=opts.bind_address, middleware=port.wrap)

        # Plain text: the kubelet's gRPC probes cannot present a client certificate. Only the
        # health service is served here.
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, health_server)
        health_server.add_insecure_port(f"{opts.bind_address}:{opts.grpc_health_port}")
        replication = self._replication()
        cross_replica = self._cross_replica()
        replication_server: grpc.aio.Server | None = None
        if replication is not None and opts.replication_cert_path:
            # The leader's stream to the standbys: mutual TLS, replicas only.
            replication_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            replication[0].add_to_server(replication_server)
            replication_server.add_secure_port(
                f"{opts.bind_address}:{opts.replication_port}",
                replica_server_credentials(opts.replication_cert_path, reload=opts.enable_cert_reload),
            )
        await self.health.start()
        await health_server.start()
        if replication_server is not None:
            await replication_server.start()

        discovery = cfg.discovery
        kube = self.kube
        server: grpc.aio.Server | None = None
        serving: list[ServingHooks] = []
        try:
            if kube is not None:
                kube.discovery.on_status = self._pool_status
                if kube.leader is not None:
                    kube.leader.on_change = self._leadership
                    pool = kube.discovery
                    kube.leader.can_lead = lambda: pool.ready  # a replica that can't serve never leads
                bind = getattr(kube.discovery, "bind_pools", None)
                if bind is not None:  # several InferencePools: each pool's pods go to its own store
                    bind(self.pools)
                await kube.start(self.store)
                self.data_layer.start_watches(kube.api, kube.discovery.namespace)
            else:
                self.data_layer.warn_without_cluster()
                if discovery is not None:
                    # a rejected update keeps the last good endpoints: reported, readiness unchanged
                    discovery.on_problem = lambda problem: self.health.set_degraded("discovery", problem)
                    await discovery.start(self._notifier())
                self.store.synced = True
                await self.health.set_condition("pool", True)
                log.info("endpoints loaded", count=len(self.store))
            self.data_layer.start()
            for hook in self._serving_hooks:
                serving.append(hook)
                await hook.start_serving()
            self.pools.primary.started = self._running = True
            for each in list(self.pools.pools.values()):  # the other pools discovery found
                await self._start_pool(each)
            if replication is not None:
                for part in replication:
                    part.start()
            if cross_replica is not None:
                cross_replica.start()  # the first round runs in the background: never delays serving
            self.pool_gauges.start()
            self.served_models.start()

            server = _extproc_server(opts)
            add_to_server(self.processor, server)
            listeners = [p for p in cfg.plugins.values() if isinstance(p, UpstreamFailureListener)]
            if listeners:  # the bootstraps' upstream log of failed attempts (passive health)
                upstream_failures.add_to_server(upstream_failures.UpstreamFailureLog(listeners), server)
            if opts.health_checking:
                health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
            _bind(server, f"{opts.bind_address}:{opts.grpc_port}", opts)
            if opts.grpc_socket:
                _bind(server, f"unix:{opts.grpc_socket}", opts)
            heap.settle()  # before serving: the collection pauses no request
            await server.start()
            await self.health.set_ready(True)
            log.info(
                "epp serving",
                grpc_port=opts.grpc_port,
                health_port=opts.grpc_health_port,
                metrics_port=opts.metrics_port,
                tls=opts.secure_serving,
            )

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.stop)
            watcher = None
            if self.config_watch is not None:
                path, load = self.config_watch
                texts: list[str] = []

                def load_kept(text: str) -> LoadedConfig:  # the text, for the other pools
                    texts[:] = [text]
                    return load(text)

                def apply(candidate: LoadedConfig, plan: Reload) -> None:
                    self.apply_reload(candidate, plan, texts[0] if texts else None)

                watch = ConfigWatcher(path, lambda: self.cfg, load_kept, apply)
                watcher = asyncio.create_task(watch.run(self._stop), name="config-watch")
            await self._stop.wait()
            if watcher is not None:
                await watcher

            log.info("shutting down", drain_delay_s=opts.drain_delay, grace_s=opts.grace_period)
            await self.health.set_ready(False)
            if kube is not None and kube.leader is not None:
                await kube.leader.stop()  # release the Lease now: a standby takes over during our drain
            # Keep serving while Envoy's health checks notice NOT_SERVING (fail-open setups move to
            # the fallback route), then stop accepting streams and let in-flight ones finish.
            try:
                await asyncio.wait_for(self._hurry.wait(), opts.drain_delay)
            except TimeoutError:
                pass
        finally:
            # Also after a failed start-up (a port in use, bad TLS files): release the Lease, close
            # the API client and stop every task, so the process exits cleanly with its error.
            for each in self.pools.pools.values():  # queued requests: 503 rejected-shutting-down
                if each.flow_control is not None:
                    each.flow_control.close()
            if server is not None:
                await server.stop(opts.grace_period)
            await self.processor.close()
            for started in reversed(serving):
                try:
                    await started.stop_serving()
                except Exception as e:
                    log.error("plugin failed to stop", plugin=repr(started), error=repr(e))
            self._running = False
            for each in list(self.pools.pools.values()):
                if each is not self.pools.primary:
                    await self._stop_pool(each)
            for pending in self._background:
                pending.cancel()
            await self.data_layer.stop()
            await self._runner.stop()
            if cross_replica is not None:
                await cross_replica.stop()
            await self.pool_gauges.stop()
            await self.served_models.stop()
            if replication is not None:
                for part in replication:
                    await part.stop()
            if kube is not None:
                await kube.stop()
            elif discovery is not None:
                await discovery.stop()
            await self.health.shutdown()
            await health_server.stop(0)
            if replication_server is not None:
                await replication_server.stop(0)


def _contributors(pool: Pool) -> list[CrossReplicaContributor]:
    """What shares a pool's state: the plugins that declare it, the saturation detector (also when
    the loader created it), and the flow controller, which is runtime, not a plugin."""
    found: list[CrossReplicaContributor] = []
    cfg = pool.cfg
    for c in (*cfg.plugins.values(), cfg.saturation_detector, pool.flow_control):
        if isinstance(c, CrossReplicaContributor) and not any(c is f for f in found):
            found.append(c)
    return found


def _extract_metadata(extractors: list[MetadataExtractor], endpoint: Endpoint) -> None:
    for extractor in extractors:
        extractor.extract_metadata(endpoint)


def _remove_endpoint_state(holders: list[EndpointStateHolder], endpoint: Endpoint) -> None:
    for holder in holders:
        holder.remove_endpoint(endpoint.metadata.key)


def _metric_owners(cfg: LoadedConfig, flow_control: FlowController | None) -> set[str]:
    """The plugin types (and features) whose metric families ``/metrics`` shows."""
    owners = {p.type_name for p in cfg.plugins.values()}
    if cfg.saturation_detector is not None:
        owners.add(cfg.saturation_detector.type_name)
    if flow_control is not None:
        owners.add("flow-control")
    return owners


def _flow_controller(cfg: LoadedConfig, store: EndpointStore, pool_name: str) -> FlowController | None:
    """The flow controller when the ``flowControl`` gate is on (it needs a saturation detector)."""
    spec = cfg.document.flow_control
    if not cfg.flow_control_enabled or spec is None:
        return None
    detector = cfg.saturation_detector
    if detector is None:
        log.warning("flowControl gate on but no saturation detector in this build: flow control is off")
        return None
    settings = settings_from_spec(spec, cfg.plugins)
    return FlowController(settings, detector, store.endpoints, pool_name=pool_name)
