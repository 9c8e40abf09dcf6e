"""Several EPP replicas behind one Envoy: a generated bootstrap's ext_proc cluster spread over them
(listed, or the addresses of one DNS name), each replica health-checked on its gRPC health port (an
unready or dead one gets no new stream)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.dev.envoy.bootstrap import EXT_PROC_CLUSTER, set_health_checks

DNS_REFRESH_RATE = "5s"
_PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
# Only failures before the EPP saw the stream: a retried stream never runs the director twice.
EXT_PROC_RETRY_ON = "connect-failure,refused-stream,reset-before-request"


@dataclass(frozen=True, slots=True)
class Replica:
    """Where Envoy reaches one EPP replica: ext_proc on ``grpc_port`` (or on the Unix socket
    ``socket``, the replica's ``--grpc-socket``), gRPC health on ``host:health_port``."""

    host: str
    grpc_port: int
    health_port: int
    socket: str = ""

    def lb_endpoint(self) -> dict[str, Any]:
        """The replica as an endpoint of Envoy's ext_proc cluster, health-checked on its health port."""
        if self.socket:
            address: dict[str, Any] = {"pipe": {"path": self.socket}}
            check: dict[str, Any] = {
                "address": {"socket_address": {"address": self.host, "port_value": self.health_port}}
            }
        else:
            address = {"socket_address": {"address": self.host, "port_value": self.grpc_port}}
            check = {"port_value": self.health_port}
        return {"endpoint": {"address": address, "health_check_config": check}}


def spread_ext_proc(
    bootstrap: Mapping[str, Any],
    replicas: Sequence[Replica],
    *,
    lb_policy: str = "ROUND_ROBIN",
    dns: bool = False,
) -> dict[str, Any]:
    """A copy of ``bootstrap`` whose ext_proc cluster balances streams over ``replicas`` (TCP, or the
    Unix socket of a replica that names one), each health-checked with gRPC on its health port.

    ``dns``: a ``STRICT_DNS`` cluster: every address a replica's ``host`` resolves to is one
    endpoint (a headless Kubernetes Service names every Ready EPP pod), re-resolved every 5 s. With
    TLS to the EPP (the cluster has a transport socket) the health checks stay plain text.
    """
    out = copy.deepcopy(dict(bootstrap))
    clusters = out["static_resources"]["clusters"]
    cluster = next(c for c in clusters if c["name"] == EXT_PROC_CLUSTER)
    cluster["lb_policy"] = lb_policy
    if dns:
        cluster["type"] = "STRICT_DNS"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
        cluster["dns_refresh_rate"] = DNS_REFRESH_RATE
    cluster["load_assignment"] = {
        "cluster_name": EXT_PROC_CLUSTER,
        "endpoints": [{"lb_endpoints": [r.lb_endpoint() for r in replicas]}],
    }
    set_health_checks(cluster, tls="transport_socket" in cluster)  # TLS to 9002: checks in plain text
    # 0 %: with every replica unhealthy there is no host (fail-open bootstraps then pass through).
    # No merge window: a health change reaches the workers at once (Envoy merges host updates for
    # 1 s by default, so a dead replica kept getting streams for up to a second after its check failed).
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}, "update_merge_window": "0s"}
    for service in ext_proc_services(out):
        service["retry_policy"] = _retry_policy()
    return out


def _retry_policy() -> dict[str, Any]:
    """An ext_proc stream that could not reach its replica (refused connection, or reset before
    the replica saw it: a dead replica its health check has not caught yet) is opened again on
    another replica; a stream the EPP has seen is never retried."""
    return {
        "retry_on": EXT_PROC_RETRY_ON,
        "num_retries": 2,
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _PREVIOUS_HOSTS},
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }


def ext_proc_services(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``grpc_service`` of every HTTP filter (ext_proc, the failure log) calling the EPP."""
    out = []
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for network_filter in chain.get("filters", []):
                for http_filter in network_filter.get("typed_config", {}).get("http_filters", []):
                    service = http_filter.get("typed_config", {}).get("grpc_service")
                    if service and service.get("envoy_grpc", {}).get("cluster_name") == EXT_PROC_CLUSTER:
                        out.append(service)
    return out
