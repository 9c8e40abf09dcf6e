"""Several EPP replicas behind one Envoy: a generated bootstrap's ext_proc cluster spread over them,
each replica health-checked on its gRPC health port (an unready or dead one gets no new stream)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.dev.envoy.bootstrap import EXT_PROC_CLUSTER, EXTPROC_HEALTH_SERVICE


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
    bootstrap: Mapping[str, Any], replicas: Sequence[Replica], *, lb_policy: str = "ROUND_ROBIN"
) -> dict[str, Any]:
    """A copy of ``bootstrap`` whose ext_proc cluster balances streams over ``replicas`` (TCP, or the
    Unix socket of a replica that names one)."""
    out = copy.deepcopy(dict(bootstrap))
    clusters = out["static_resources"]["clusters"]
    cluster = next(c for c in clusters if c["name"] == EXT_PROC_CLUSTER)
    cluster["lb_policy"] = lb_policy
    cluster["load_assignment"] = {
        "cluster_name": EXT_PROC_CLUSTER,
        "endpoints": [{"lb_endpoints": [r.lb_endpoint() for r in replicas]}],
    }
    cluster["health_checks"] = [
        {
            "timeout": "1s",
            "interval": "0.5s",
            "no_traffic_interval": "0.5s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "reuse_connection": True,
            "grpc_health_check": {"service_name": EXTPROC_HEALTH_SERVICE},
        }
    ]
    # 0 %: with every replica unhealthy there is no host (fail-open bootstraps then pass through).
    # No merge window: a health change reaches the workers at once (Envoy merges host updates for
    # 1 s by default, so a dead replica kept getting streams for up to a second after its check failed).
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}, "update_merge_window": "0s"}
    return out
