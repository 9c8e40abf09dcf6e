"""Everything ``epp serve`` runs against a cluster, built from the command line."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import structlog
from kubernetes_asyncio import client

from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.rewrites import RewriteStore
from epp.framework import EndpointNotifier
from epp.k8s.client import api_client
from epp.k8s.leader import LeaderElector, lease_name, new_identity
from epp.k8s.pods import PoolSpec
from epp.k8s.policy_watchers import PolicyWatchers
from epp.k8s.pool_discovery import DEFAULT_APP_PROTOCOLS, PoolDiscovery, parse_endpoint_selector
from epp.k8s.pool_policies import PoolPolicies
from epp.k8s.pool_set import PoolSetDiscovery
from epp.k8s.resources import POOL_GROUP

log = structlog.get_logger("epp.k8s")


@dataclass(slots=True)
class KubeOptions:
    namespace: str = "default"
    pool_name: str = ""  # InferencePool mode
    pool_group: str = POOL_GROUP
    pool_names: tuple[str, ...] = ()  # several InferencePools (--pool-name repeated)
    pool_selector: str = ""  # every InferencePool with these labels (--pool-selector)
    selector: dict[str, str] = field(default_factory=dict)  # standalone mode
    target_ports: tuple[int, ...] = ()
    kubeconfig: str | None = None
    metrics_port: int | None = None  # --model-server-metrics-port (one target port only)
    leader_election: bool = False
    lease_name: str = ""  # default: lease_name(namespace, pool)
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    pod_name: str = ""  # POD_NAME: the leader identity's prefix
    advertise_address: str = ""  # where standbys reach this replica's replication stream


@dataclass(slots=True)
class KubeRuntime:
    """The API client, endpoint discovery, the InferenceObjective/InferenceModelRewrite watchers
    (InferencePool mode only) and the leader elector; the server starts and stops them."""

    api: client.ApiClient
    discovery: PoolDiscovery | PoolSetDiscovery
    policy_watchers: PolicyWatchers | None = None
    leader: LeaderElector | None = None
    objectives: ObjectiveStore | None = None
    rewrites: RewriteStore | None = None

    @classmethod
    async def build(
        cls, opts: KubeOptions, *, pool_name: str, app_protocols: Collection[str] = DEFAULT_APP_PROTOCOLS
    ) -> KubeRuntime:
        """``pool_name`` is the pool's identity (the InferencePool, or the standalone pool's name)."""
        api = await api_client(opts.kubeconfig)
        objectives: ObjectiveStore | None
        rewrites: RewriteStore | None
        policy_watchers: PolicyWatchers | None
        discovery: PoolDiscovery | PoolSetDiscovery
        if opts.pool_names or opts.pool_selector:
            policies = PoolPolicies(opts.pool_group)
            discovery = PoolSetDiscovery(
                api,
                opts.namespace,
                names=opts.pool_names,
                selector=_selector_text(opts.pool_selector),
                pool_group=opts.pool_group,
                metrics_port=opts.metrics_port,
                app_protocols=app_protocols,
                policies=policies,
            )
            objectives = rewrites = None  # each pool has its own stores (PoolPolicies)
            policy_watchers = PolicyWatchers(
                api, opts.namespace, objectives=policies.objectives, rewrites=policies.rewrites
            )
            log.info("several InferencePools", pools=list(opts.pool_names), selector=opts.pool_selector)
        elif opts.pool_name:
            discovery = PoolDiscovery(
                api,
                opts.namespace,
                pool_name=opts.pool_name,
                pool_group=opts.pool_group,
                metrics_port=opts.metrics_port,
                app_protocols=app_protocols,
            )
            objectives = ObjectiveStore(pool_name=opts.pool_name, pool_group=opts.pool_group)
            rewrites = RewriteStore(pool_name=opts.pool_name, pool_group=opts.pool_group)
            policy_watchers = PolicyWatchers(api, opts.namespace, objectives=objectives, rewrites=rewrites)
        else:
            spec = PoolSpec(selector=opts.selector, target_ports=opts.target_ports)
            discovery = PoolDiscovery(
                api, opts.namespace, spec=spec, metrics_port=opts.metrics_port, app_protocols=app_protocols
            )
            objectives = rewrites = None
            policy_watchers = None
            log.info("standalone mode: InferenceObjective and InferenceModelRewrite are not watched")
        leader = None
        if opts.leader_election:
            leader = LeaderElector(
                api,
                opts.namespace,
                opts.lease_name or lease_name(opts.namespace, pool_name),
                new_identity(opts.pod_name),
                lease_duration=opts.lease_duration,
                renew_deadline=opts.renew_deadline,
                retry_period=opts.retry_period,
                advertise=opts.advertise_address,
            )
        return cls(api, discovery, policy_watchers, leader, objectives, rewrites)

    async def start(self, notifier: EndpointNotifier) -> None:
        await self.discovery.start(notifier)
        if self.policy_watchers is not None:
            self.policy_watchers.start()
        if self.leader is not None:
            self.leader.start()

    async def stop(self) -> None:
        if self.leader is not None:
            await self.leader.stop()  # first: a standby takes over while we drain
        if self.policy_watchers is not None:
            await self.policy_watchers.stop()
        await self.discovery.stop()
        await self.api.close()


def _selector_text(selector: str) -> str:
    """``k=v,...`` in the API's label-selector syntax ("" selects every pool)."""
    if not selector:
        return ""
    return ",".join(f"{k}={v}" for k, v in parse_endpoint_selector(selector).items())
