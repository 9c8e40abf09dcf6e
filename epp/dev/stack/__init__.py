"""The local stack: simulators, the EPP and Envoy as supervised child processes on 127.0.0.1.

``supervisor`` runs and restarts the processes, ``probes`` finds free ports and waits for readiness,
``commands`` and ``files`` are what the children are started with, ``redis_server`` and ``replicas``
are the pieces of several EPPs sharing state (a private ``redis-server``, Envoy's ext_proc cluster
spread over them), ``local`` composes them
(:class:`Stack`, and ``epp run``'s :class:`LocalStack`) and ``cli`` is ``epp run``. This package
re-exports the names the benchmarks and the integration tests use.
"""

from epp.dev.stack.commands import envoy_argv, epp_socket, python_argv, serve_argv, sim_argv
from epp.dev.stack.files import (
    endpoints_document,
    epp_config,
    one_profile_config,
    with_redis_syncer,
    write_atomic,
    write_endpoints,
)
from epp.dev.stack.local import (
    EppPorts,
    LocalStack,
    Stack,
    StackOptions,
    kv_events_labels,
    kv_events_sim_args,
)
from epp.dev.stack.probes import (
    READY_TIMEOUT,
    Interrupted,
    envoy_hosts_healthy,
    free_port,
    free_port_block,
    free_ports,
    grpc_serving,
    http_ok,
    http_status,
    port_in_use,
    wait_until,
)
from epp.dev.stack.supervisor import Child, ChildExited, RestartPolicy, Supervisor

__all__ = [
    "READY_TIMEOUT",
    "Child",
    "ChildExited",
    "EppPorts",
    "Interrupted",
    "LocalStack",
    "RestartPolicy",
    "Stack",
    "StackOptions",
    "Supervisor",
    "endpoints_document",
    "envoy_argv",
    "envoy_hosts_healthy",
    "epp_config",
    "epp_socket",
    "free_port",
    "free_port_block",
    "free_ports",
    "grpc_serving",
    "http_ok",
    "http_status",
    "kv_events_labels",
    "kv_events_sim_args",
    "one_profile_config",
    "port_in_use",
    "python_argv",
    "serve_argv",
    "sim_argv",
    "wait_until",
    "with_redis_syncer",
    "write_atomic",
    "write_endpoints",
]
