"""Envoy bootstrap generator for running Envoy in front of the EPP.

``envoy_bootstrap()`` returns a complete static Envoy v3 bootstrap as a ``dict`` (fail-closed or
fail-open, any request body mode, the response phases asked for, optional mutual TLS to the EPP);
``render()`` turns it into YAML. The layout and the Envoy behaviour it relies on are described in
deploy/README.md.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from epp.framework.wire import (
    DESTINATION_HEADER,
    FALLBACK_HEADER,
    LB_NAMESPACE,
    POOL_METADATA_KEY,
    REWRITE_METADATA_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

EXT_PROC_CLUSTER = "ext_proc"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
# The second ext_proc filter of the FULL_DUPLEX_STREAMED bootstraps (see rewrite_response_filter).
REWRITE_FILTER = "epp-response-rewrite"
REWRITE_STAT_PREFIX = "rewrite"
ORIGINAL_DST_CLUSTER = "original_destination_cluster"
# Fail-over (see failover_clusters): attempt 1 to the EPP's destination, the one retry to its fallback.
FALLBACK_DST_CLUSTER = "fallback_destination_cluster"
FAILOVER_CLUSTER = "epp_destination"
# Retried once, only while the client has received nothing: no connection, or a reset before any
# response byte (an engine closing an idle keep-alive connection as the request arrives, or dying
# before it answered); never on a response, so no output is ever delivered twice.
FAILOVER_RETRY_ON = "connect-failure,reset"
# Engine connections idle this long are closed by Envoy, before the engine closes them itself:
# vLLM's server (uvicorn) closes idle keep-alive connections after 5 s, and a request Envoy sends on
# a connection the engine is closing fails (503, flag UC). Below every engine's keep-alive.
UPSTREAM_IDLE_TIMEOUT = "4s"
# The upstream access log of failed attempts, streamed to the EPP's AccessLogService (passive health).
UPSTREAM_FAILURE_LOG = "epp-upstream-failures"
# Envoy response flags of attempts that failed at the engine: connection failure, connection
# termination, remote and local reset, retries exhausted.
UPSTREAM_FAILURE_FLAGS = ("UF", "UC", "UR", "LR", "URX")
# The response header naming the engine of an upstream failure's local reply.
FAILED_ENDPOINT_HEADER = "x-epp-upstream-endpoint"
FALLBACK_CLUSTER = "fallback_cluster"

# The generated default (docs/deploy.md, "The Envoy exchange"): the whole body in one message, no
# echo; with no response phase the exchange is 2 messages each way. FULL_DUPLEX_STREAMED is what
# gateways configure (the reference layout).
DEFAULT_BODY_MODE = "BUFFERED"
HEADER_MODES: tuple[str, ...] = ("SEND", "SKIP")

BodyMode = Literal["NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED"]
BODY_MODES: tuple[str, ...] = ("NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED")

# Headers removed from every client request before ext_proc runs (see module docstring).
DEFAULT_STRIPPED_HEADERS: tuple[str, ...] = (DESTINATION_HEADER, FALLBACK_HEADER)

# The reference listener limit; it bounds chunk sizes in streamed modes (not the total body).
CONNECTION_BUFFER_LIMIT = 32768
# In BUFFERED mode Envoy holds the whole request body before ext_proc sees it and answers 413 above the
# buffer limit; the reference layout (FULL_DUPLEX_STREAMED) has no such limit, so raise it per route.
BUFFERED_BODY_LIMIT = 64 * 1024 * 1024
LONG_TIMEOUT = "86400s"
# Bounds on a frozen or unreachable EPP (see ext_proc_filter and ext_proc_cluster).
MESSAGE_TIMEOUT = "5s"
# The most a queued request's reply may be delayed: flow control extends the message timer of a
# BUFFERED request it holds (override_message_timeout), up to this bound.
MAX_MESSAGE_TIMEOUT = "3600s"
EXTPROC_CONNECT_TIMEOUT = "2s"
EXTPROC_KEEPALIVE = {"interval": "1s", "timeout": "2s"}
CIRCUIT_BREAKER_LIMIT = 40000
MAX_DOWNSTREAM_CONNECTIONS = 50000

_TYPE = "type.googleapis.com/envoy.extensions"


@dataclass(frozen=True, slots=True)
class EppTls:
    """Authenticated TLS from Envoy to the EPP.

    ``cert_dir`` holds ``ca.crt`` (the CA the EPP's certificate must be signed by) and, with
    ``client_certificate``, Envoy's own ``tls.crt``/``tls.key`` (a mounted Kubernetes Secret).
    ``server_name`` is sent as SNI and must be a DNS name of the EPP's certificate. The files are
    delivered through file-based SDS: :func:`sds_files` are written into ``sds_dir`` next to the
    bootstrap, and Envoy re-reads the certificates when ``cert_dir`` changes (a renewed Secret).
    """

    cert_dir: str
    sds_dir: str
    server_name: str = "epp"
    client_certificate: bool = True


SDS_CERTIFICATE_FILE = "sds-epp-client-certificate.yaml"
SDS_HEADER = "# Generated with the Envoy bootstrap (file-based SDS for its TLS to the EPP); do not edit.\n"
SDS_CA_FILE = "sds-epp-ca.yaml"
_SECRET_TYPE = f"{_TYPE}.transport_sockets.tls.v3.Secret"


def envoy_bootstrap(
    *,
    listen_port: int = 8081,
    admin_port: int = 19000,
    extproc_host: str = "127.0.0.1",
    extproc_port: int = 9002,
    body_mode: str = DEFAULT_BODY_MODE,
    response_body_mode: str = "NONE",
    response_header_mode: str = "SEND",
    fail_open: bool = False,
    fallback_endpoints: Sequence[str] = (),
    subset_hint_header: str | None = None,
    tls: bool | EppTls = False,
    extproc_health_port: int | None = None,
    extproc_socket: str = "",
    listen_host: str = "127.0.0.1",
    stripped_headers: Sequence[str] = DEFAULT_STRIPPED_HEADERS,
    access_log: bool = False,
    failover: bool = True,
    pools: Sequence[str] = (),
) -> dict[str, Any]:
    """Build an Envoy bootstrap routing every request through the EPP's ext_proc service.

    ``pools``: one EPP serving several InferencePools. Each pool gets a virtual host whose domain is
    the pool's name (``Host: NAME``); its routes tell the EPP the pool through the ext_proc stream's
    gRPC metadata (``ExtProcPerRoute`` ``grpc_initial_metadata`` ``x-epp-pool: NAME``). Other hosts
    name no pool (the EPP then goes by the subset hint, else answers 404).

    ``failover``: a request whose engine cannot be reached (connection refused, reset before any
    response) is retried once on the EPP's fallback endpoint (``failover_clusters``), and each such
    failed attempt is reported to the EPP's AccessLogService (passive health).

    ``fail_open`` requires ``fallback_endpoints`` (``"ip:port"`` strings): they serve the requests
    that pass through without an EPP decision. ``subset_hint_header`` names a request header whose
    value (``"ip:port,ip:port"``) becomes the subset hint. ``tls=True`` talks TLS to the EPP and
    accepts any certificate (the reference layout, for its self-signed one: not authenticated); an
    :class:`EppTls` verifies the EPP and presents a client certificate; otherwise plain-text HTTP/2.

    ``extproc_socket``: Envoy reaches the EPP on that Unix socket (``epp serve --grpc-socket``; a
    sidecar in the same pod), else on ``extproc_host:extproc_port``.

    ``extproc_health_port`` is the EPP's gRPC health port (plain text). When set, Envoy actively
    health-checks the EPP there and treats it as absent while it is not SERVING (panic threshold 0).
    Fail-open needs this with FULL_DUPLEX_STREAMED: Envoy can only fail open before the first body
    chunk went to the EPP, and without health checks it learns that the EPP is unreachable only
    after it has streamed the body into the failing connection (500, measured on 1.40). Default:
    ``extproc_port + 1`` (the EPP's 9002/9003 convention) when ``fail_open``, else none; 0 disables.
    """
    _check_mode("body_mode", body_mode)
    _check_mode("response_body_mode", response_body_mode)
    _check_header_mode("response_header_mode", response_header_mode)
    if fail_open and not fallback_endpoints:
        raise ValueError("fail_open=True needs at least one fallback endpoint")
    if extproc_health_port is None:
        extproc_health_port = extproc_port + 1 if fail_open else 0
    clusters = [
        ext_proc_cluster(
            extproc_host,
            extproc_port,
            tls=tls,
            health_port=extproc_health_port or None,
            socket=extproc_socket,
        ),
        original_dst_cluster(max_retries=CIRCUIT_BREAKER_LIMIT if failover else None),
    ]
    if failover:
        clusters.extend(failover_clusters())
    if fail_open:
        clusters.append(static_cluster(FALLBACK_CLUSTER, fallback_endpoints))
    filters = http_filters(
        body_mode=body_mode,
        response_body_mode=response_body_mode,
        response_header_mode=response_header_mode,
        fail_open=fail_open,
        subset_hint_header=subset_hint_header,
        authority=f"{extproc_host}:{extproc_port}",
        failover=failover,
    )
    routes = route_config(
        fail_open=fail_open,
        buffered=body_mode in ("BUFFERED", "BUFFERED_PARTIAL", "STREAMED"),
        rewrite_route=needs_rewrite_filter(body_mode, response_body_mode, response_header_mode),
        failover=failover,
    )
    if pools:
        routes = pool_routes(routes, pools)
    hcm = http_connection_manager(
        filters,
        routes,
        stripped_headers=stripped_headers,
        access_log=access_log,
    )
    hcm["local_reply_config"] = local_reply_config()
    bootstrap: dict[str, Any] = {}
    if isinstance(tls, EppTls):
        bootstrap["node"] = {"id": "epp-envoy", "cluster": "epp"}  # file-based SDS requires a node
    return {
        **bootstrap,
        "admin": {"address": _socket_address("127.0.0.1", admin_port)},
        "overload_manager": overload_manager(),
        "static_resources": {
            "listeners": [data_listener(listen_host, listen_port, hcm)],
            "clusters": clusters,
        },
    }


def render(bootstrap: dict[str, Any]) -> str:
    """Render a bootstrap dict as YAML (key order preserved, block style)."""
    return yaml.safe_dump(bootstrap, sort_keys=False, default_flow_style=False, width=110)


# --------------------------------------------------------------------------------------------- filters


def http_filters(
    *,
    body_mode: str,
    response_body_mode: str,
    response_header_mode: str = "SEND",
    fail_open: bool,
    subset_hint_header: str | None,
    authority: str,
    failover: bool = False,
) -> list[dict[str, Any]]:
    """The HTTP filter chain: [subset hint], ext_proc, router (with ``failover``, the router logs
    every failed upstream attempt to the EPP)."""
    filters: list[dict[str, Any]] = []
    if subset_hint_header:
        filters.append(subset_hint_filter(subset_hint_header))
    filters.append(
        ext_proc_filter(
            body_mode=body_mode,
            response_body_mode=response_body_mode,
            response_header_mode=response_header_mode,
            fail_open=fail_open,
            authority=authority,
        )
    )
    if needs_rewrite_filter(body_mode, response_body_mode, response_header_mode):
        filters.append(rewrite_response_filter(fail_open=fail_open, authority=authority))
    router: dict[str, Any] = {
        "@type": f"{_TYPE}.filters.http.router.v3.Router",
        "suppress_envoy_headers": True,
    }
    if failover:
        router["upstream_log"] = [upstream_failure_log(authority)]
    filters.append({"name": "envoy.filters.http.router", "typed_config": router})
    return filters


def upstream_failure_log(authority: str) -> dict[str, Any]:
    """Per upstream attempt that failed at the engine (``UPSTREAM_FAILURE_FLAGS``, or a 5xx from
    it): an entry streamed to the EPP's gRPC AccessLogService on the ext_proc cluster, which feeds
    ``endpoint-health-filter``. Successful attempts are not logged, so healthy traffic costs nothing.
    """
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {
            "or_filter": {
                "filters": [
                    {"response_flag_filter": {"flags": list(UPSTREAM_FAILURE_FLAGS)}},
                    {"status_code_filter": {"comparison": {"op": "GE", "value": {"default_value": 500}}}},
                ]
            }
        },
        "typed_config": {
            "@type": f"{_TYPE}.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": UPSTREAM_FAILURE_LOG,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER, "authority": authority}},
                "buffer_flush_interval": "0.05s",
                "buffer_size_bytes": 4096,
            },
        },
    }


def strip_headers_extension(headers: Sequence[str]) -> dict[str, Any]:
    """An early header mutation removing the given request headers (client input the EPP owns).

    It runs in the connection manager before the route is chosen. An HTTP filter
    (``envoy.filters.http.header_mutation``) is not enough: the connection manager picks the route
    as soon as the headers arrive, so with fail-open and the EPP down a client-sent destination
    header would still select the ORIGINAL_DST route (whose header is gone by then: 503).
    """
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": f"{_TYPE}.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": name.lower()} for name in headers],
        },
    }


def subset_hint_filter(header: str) -> dict[str, Any]:
    """Copy request header ``header`` into ``envoy.lb.subset_hint`` metadata (and drop the header)."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": f"{_TYPE}.filters.http.header_to_metadata.v3.Config",
            "request_rules": [
                {
                    "header": header.lower(),
                    "on_header_present": {
                        "metadata_namespace": SUBSET_NAMESPACE,
                        "key": SUBSET_KEY,
                        "type": "STRING",
                    },
                    "remove": True,
                }
            ],
        },
    }


def processing_mode(
    body_mode: str, response_body_mode: str, response_header_mode: str = "SEND"
) -> dict[str, str]:
    """ext_proc processing mode; full-duplex bodies require the matching trailer mode SEND.

    ``response_trailer_mode: SEND`` is always on: it keeps the ext_proc stream open until the HTTP
    stream ends (Envoy half-closes it then; a response_trailers message comes only when the upstream
    sends trailers), so the EPP's in-flight accounting covers the whole response at no extra
    message. Without it Envoy 1.40 closes the stream right after the response headers in
    FULL_DUPLEX_STREAMED mode (in-flight state released at the first byte).
    """
    mode = {
        "request_header_mode": "SEND",
        "response_header_mode": response_header_mode,
        "request_body_mode": body_mode,
        "response_body_mode": response_body_mode,
    }
    if body_mode == "FULL_DUPLEX_STREAMED":
        mode["request_trailer_mode"] = "SEND"
    mode["response_trailer_mode"] = "SEND"
    return mode


def _ext_proc_service(authority: str) -> dict[str, Any]:
    return {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER, "authority": authority}, "timeout": "10s"}


def ext_proc_filter(
    *,
    body_mode: str,
    response_body_mode: str,
    response_header_mode: str = "SEND",
    fail_open: bool,
    authority: str,
) -> dict[str, Any]:
    """The ext_proc filter calling the EPP: the reference settings plus the metadata options.

    ``STREAMED`` request bodies are sent without waiting for the headers reply: the EPP answers the
    headers (the routing) once the body is complete, then each chunk with an empty reply.
    """
    config: dict[str, Any] = {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": f"{_TYPE}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": _ext_proc_service(authority),
            "failure_mode_allow": fail_open,
            # Per message awaiting a reply (BUFFERED; no timeout applies to FULL_DUPLEX_STREAMED
            # bodies): a frozen EPP fails the request within this bound. The EPP answers in ms.
            "message_timeout": MESSAGE_TIMEOUT,
            "max_message_timeout": MAX_MESSAGE_TIMEOUT,
            "processing_mode": processing_mode(body_mode, response_body_mode, response_header_mode),
            # BUFFERED: the EPP asks for the response body of a model-rewritten request in its
            # response-headers reply (ignored by Envoy 1.40 in FULL_DUPLEX_STREAMED mode).
            "allow_mode_override": True,
            "metadata_options": {
                # Without receiving_namespaces Envoy silently drops the EPP's envoy.lb metadata.
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                "forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]},
            },
        },
    }
    if body_mode == "STREAMED":
        config["typed_config"]["send_body_without_waiting_for_header_response"] = True
    return config


def needs_rewrite_filter(body_mode: str, response_body_mode: str, response_header_mode: str = "SEND") -> bool:
    """Whether model-rewritten responses need the second filter: no response body reaches the
    main one and it cannot ask for it per request (Envoy ignores a mode override in full duplex and
    with STREAMED bodies sent without waiting; without response headers there is nothing to ask in)."""
    if response_body_mode != "NONE":
        return False
    return body_mode in ("FULL_DUPLEX_STREAMED", "STREAMED") or response_header_mode == "SKIP"


_NOTHING = {
    "request_header_mode": "SKIP",
    "response_header_mode": "SKIP",
    "request_body_mode": "NONE",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}
_REWRITE_RESPONSE = {
    **_NOTHING,
    "response_header_mode": "SEND",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "response_trailer_mode": "SEND",
}


def rewrite_response_filter(*, fail_open: bool, authority: str) -> dict[str, Any]:
    """A second ext_proc filter to the EPP that reverses a model rewrite in the response body.

    By default it sends nothing (no stream is opened). The ``epp-rewritten`` route (chosen after the
    EPP's reply, on the rewrite metadata the EPP sets only when it rewrote the model) turns on its
    response phases; its stream then starts at the response headers and carries the incoming and
    target model in the forwarded ``envoy.lb`` metadata. Only rewritten requests pay for it.
    """
    return {
        "name": REWRITE_FILTER,
        "typed_config": {
            "@type": f"{_TYPE}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": _ext_proc_service(authority),
            "failure_mode_allow": fail_open,
            "message_timeout": MESSAGE_TIMEOUT,
            "stat_prefix": REWRITE_STAT_PREFIX,  # http.<hcm>.ext_proc.rewrite.streams_started, ...
            "processing_mode": dict(_NOTHING),
            "metadata_options": {"forwarding_namespaces": {"untyped": [LB_NAMESPACE]}},
        },
    }


def _rewritten_route(cluster: str = ORIGINAL_DST_CLUSTER) -> dict[str, Any]:
    route = _route(cluster, name="epp-rewritten")
    route["match"]["dynamic_metadata"] = [
        {"filter": LB_NAMESPACE, "path": [{"key": REWRITE_METADATA_KEY}], "value": {"present_match": True}}
    ]
    route["typed_per_filter_config"] = {
        REWRITE_FILTER: {
            "@type": f"{_TYPE}.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": dict(_REWRITE_RESPONSE)},
        }
    }
    return route


# ---------------------------------------------------------------------------------- listener, routes


def route_config(
    *, fail_open: bool, buffered: bool, rewrite_route: bool = False, failover: bool = False
) -> dict[str, Any]:
    """Routes: ORIGINAL_DST for EPP-picked requests; fail-open adds a catch-all to the fallback cluster.

    ``rewrite_route`` puts the ``epp-rewritten`` route (see ``rewrite_response_filter``) first.
    ``failover``: EPP-picked routes go to the fail-over cluster with one retry (``FAILOVER_RETRY_ON``).
    """
    picked = FAILOVER_CLUSTER if failover else ORIGINAL_DST_CLUSTER
    routes: list[dict[str, Any]] = [_rewritten_route(picked)] if rewrite_route else []
    if fail_open:
        routes.append(
            _route(
                picked,
                headers=[{"name": DESTINATION_HEADER, "present_match": True}],
                name="epp-picked",
            )
        )
        routes.append(_route(FALLBACK_CLUSTER, name="fallback"))
    else:
        routes.append(_route(picked, name="epp-picked"))
    if failover:
        for route in routes:
            if route["route"]["cluster"] == FAILOVER_CLUSTER:
                route["route"]["retry_policy"] = {"retry_on": FAILOVER_RETRY_ON, "num_retries": 1}
    vhost: dict[str, Any] = {"name": "inference", "domains": ["*"], "routes": routes}
    if buffered:
        vhost["request_body_buffer_limit"] = BUFFERED_BODY_LIMIT
    return {"name": "inference", "virtual_hosts": [vhost]}


def pool_routes(routes: dict[str, Any], pools: Sequence[str]) -> dict[str, Any]:
    """A virtual host per pool (domain: the pool's name) ahead of the catch-all one, its routes
    naming the pool to the EPP in the ext_proc stream's gRPC metadata."""
    default = routes["virtual_hosts"][0]
    hosts: list[dict[str, Any]] = []
    for pool in dict.fromkeys(pools):
        vhost = copy.deepcopy(default)
        vhost["name"] = f"pool-{pool}"
        vhost["domains"] = [pool, f"{pool}:*"]
        for route in vhost["routes"]:
            route["name"] = f"{route['name']}-{pool}"
            per_route = route.setdefault("typed_per_filter_config", {})
            per_route[EXT_PROC_FILTER] = {
                "@type": f"{_TYPE}.filters.http.ext_proc.v3.ExtProcPerRoute",
                "overrides": {"grpc_initial_metadata": [{"key": POOL_METADATA_KEY, "value": pool}]},
            }
        hosts.append(vhost)
    return {**routes, "virtual_hosts": [*hosts, default]}


def _route(cluster: str, *, name: str, headers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    match: dict[str, Any] = {"prefix": "/"}
    if headers:
        match["headers"] = headers
    return {
        "name": name,
        "match": match,
        "route": {
            "cluster": cluster,
            "timeout": LONG_TIMEOUT,
            "idle_timeout": LONG_TIMEOUT,
            "upgrade_configs": [{"upgrade_type": "websocket"}],
        },
    }


def http_connection_manager(
    filters: list[dict[str, Any]],
    routes: dict[str, Any],
    *,
    stripped_headers: Sequence[str] = DEFAULT_STRIPPED_HEADERS,
    access_log: bool = False,
) -> dict[str, Any]:
    """The data listener's HTTP connection manager (the reference's settings)."""
    hcm: dict[str, Any] = {
        "@type": f"{_TYPE}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "server_header_transformation": "PASS_THROUGH",
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
        "http2_protocol_options": {
            "max_concurrent_streams": 100,
            "initial_stream_window_size": 65536,
            "initial_connection_window_size": 1048576,
        },
        "route_config": routes,
        "http_filters": filters,
        # The client's x-request-id is kept (else Envoy makes one) and returned in the response: the
        # id the EPP's decision log and /debug/decisions show.
        "preserve_external_request_id": True,
        "always_set_request_id_in_response": True,
    }
    if stripped_headers:
        hcm["early_header_mutation_extensions"] = [strip_headers_extension(stripped_headers)]
    if access_log:
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": f"{_TYPE}.access_loggers.stream.v3.StdoutAccessLog",
                    "log_format": {"json_format": _ACCESS_LOG_FORMAT},
                },
            }
        ]
    return hcm


# (Envoy response flags, error type, error code, message) of the local replies rewritten to
# OpenAI-style JSON, first match first; the status Envoy chose is kept.
_UPSTREAM_REPLIES: tuple[tuple[tuple[str, ...], str, str, str], ...] = (
    (("UT",), "timeout", "upstream_timeout", "the model server did not answer in time"),
    (("UH",), "service_unavailable", "no_healthy_upstream", "no model server is available for the request"),
    (
        ("UF", "URX"),
        "service_unavailable",
        "upstream_connect_failure",
        "the model server could not be reached",
    ),
    (
        ("UC", "UR", "LR", "UO"),
        "service_unavailable",
        "upstream_reset",
        "the connection to the model server was reset before a response",
    ),
)


def local_reply_config() -> dict[str, Any]:
    """Envoy's own replies to upstream failures as OpenAI-style errors, as the EPP's errors are:
    ``{"error": {"message", "type", "code"}}`` (Envoy's detail appended to the message), the status
    kept, and the engine tried last (when there was one) in ``x-epp-upstream-endpoint``. Replies
    without an upstream failure flag (the EPP's ImmediateResponses among them) pass unchanged.
    """
    mappers = []
    for flags, kind, code, message in _UPSTREAM_REPLIES:
        mappers.append(
            {
                "filter": {"response_flag_filter": {"flags": list(flags)}},
                "headers_to_add": [
                    {
                        "header": {"key": FAILED_ENDPOINT_HEADER, "value": "%UPSTREAM_HOST%"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
                "body_format_override": {
                    "json_format": {
                        "error": {
                            "message": f"{message} (%LOCAL_REPLY_BODY%)",
                            "type": kind,
                            "code": code,
                        }
                    },
                },
            }
        )
    return {"mappers": mappers}


_ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "response_code": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "upstream_host": "%UPSTREAM_HOST%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "duration_ms": "%DURATION%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "epp_decision": "%DYNAMIC_METADATA(envoy.lb:epp.decision:summary)%",  # why the EPP picked the endpoint
}


def data_listener(host: str, port: int, hcm: dict[str, Any]) -> dict[str, Any]:
    """The data listener wrapping the HTTP connection manager."""
    return {
        "name": "inference",
        "address": _socket_address(host, port),
        "per_connection_buffer_limit_bytes": CONNECTION_BUFFER_LIMIT,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }


def overload_manager(max_connections: int = MAX_DOWNSTREAM_CONNECTIONS) -> dict[str, Any]:
    """A global cap on downstream connections (Envoy warns at start-up when there is none)."""
    return {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": f"{_TYPE}.resource_monitors.downstream_connections.v3."
                    "DownstreamConnectionsConfig",
                    "max_active_downstream_connections": max_connections,
                },
            }
        ]
    }


# ------------------------------------------------------------------------------------------- clusters


def ext_proc_cluster(
    host: str, port: int, *, tls: bool | EppTls, health_port: int | None = None, socket: str = ""
) -> dict[str, Any]:
    """The EPP as an HTTP/2 (gRPC) cluster; ``tls=True`` accepts any certificate, an
    :class:`EppTls` authenticates both sides. ``socket``: reach it on that Unix socket (the EPP's
    ``--grpc-socket``) instead of ``host:port``.

    With ``health_port`` the EPP's standard gRPC health service is checked there on ``host`` (always
    plain text, also when ext_proc uses TLS), and an unhealthy EPP counts as no host at all.
    """
    cluster: dict[str, Any] = {
        "name": EXT_PROC_CLUSTER,
        "type": "STATIC",
        "connect_timeout": EXTPROC_CONNECT_TIMEOUT,
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": _circuit_breakers(max_retries=1024),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPE}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "initial_stream_window_size": 65536,
                        "initial_connection_window_size": 1048576,
                        # HTTP/2 PINGs: a frozen EPP (no PING ack) loses its connection, and with it
                        # every open ext_proc stream, within interval + timeout. A live EPP answers
                        # them however long a generation streams (its gRPC server accepts the rate).
                        "connection_keepalive": dict(EXTPROC_KEEPALIVE),
                    }
                },
            }
        },
        "load_assignment": _load_assignment(EXT_PROC_CLUSTER, [(host, port)]),
    }
    if socket:
        endpoint = {"endpoint": {"address": {"pipe": {"path": socket}}}}
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [endpoint]}]
    if tls:
        cluster["transport_socket"] = upstream_tls_socket(tls)
    if health_port:
        _add_health_check(cluster, health_port, tls=bool(tls), host=host if socket else "")
    return cluster


def upstream_tls_socket(tls: bool | EppTls) -> dict[str, Any]:
    """The ext_proc cluster's TLS transport socket (ALPN h2)."""
    if not isinstance(tls, EppTls):  # accepts any certificate: the reference's empty validation context
        common: dict[str, Any] = {"alpn_protocols": ["h2"], "validation_context": {}}
        return _tls_socket({"common_tls_context": common})
    common = {
        "alpn_protocols": ["h2"],
        "combined_validation_context": {
            "default_validation_context": {
                "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": tls.server_name}}]
            },
            "validation_context_sds_secret_config": _sds_ref(tls, "epp-ca", SDS_CA_FILE),
        },
    }
    if tls.client_certificate:
        common["tls_certificate_sds_secret_configs"] = [
            _sds_ref(tls, "epp-client-certificate", SDS_CERTIFICATE_FILE)
        ]
    return _tls_socket({"sni": tls.server_name, "common_tls_context": common})


def _tls_socket(context: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {"@type": f"{_TYPE}.transport_sockets.tls.v3.UpstreamTlsContext", **context},
    }


def _sds_ref(tls: EppTls, name: str, file: str) -> dict[str, Any]:
    return {
        "name": name,
        "sds_config": {"resource_api_version": "V3", "path_config_source": {"path": f"{tls.sds_dir}/{file}"}},
    }


def sds_files(tls: EppTls) -> dict[str, dict[str, Any]]:
    """The file-based SDS resources an :class:`EppTls` bootstrap reads, by file name.

    Each names files in ``cert_dir`` and watches that directory, so Envoy reloads them when a
    renewed Secret is swapped in (Kubernetes replaces the directory's ``..data`` symlink).
    """
    watch = {"path": tls.cert_dir}
    files = {
        SDS_CA_FILE: _sds_resource(
            "epp-ca", {"validation_context": {"trusted_ca": {"filename": f"{tls.cert_dir}/ca.crt"}}}, watch
        )
    }
    if tls.client_certificate:
        certificate = {
            "certificate_chain": {"filename": f"{tls.cert_dir}/tls.crt"},
            "private_key": {"filename": f"{tls.cert_dir}/tls.key"},
        }
        files[SDS_CERTIFICATE_FILE] = _sds_resource(
            "epp-client-certificate", {"tls_certificate": certificate}, watch
        )
    return files


def _sds_resource(name: str, body: dict[str, Any], watch: dict[str, str]) -> dict[str, Any]:
    (kind,) = body
    return {
        "resources": [{"@type": _SECRET_TYPE, "name": name, kind: {**body[kind], "watched_directory": watch}}]
    }


EXTPROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


# The EPP is ejected after this many failed health checks in a row: one late answer of an EPP
# sharing its CPUs with engines must not fail every request for an interval.
HEALTH_UNHEALTHY_THRESHOLD = 3
HEALTH_CHECK_TIMEOUT = "2s"


def set_health_checks(cluster: dict[str, Any], *, tls: bool) -> None:
    """Active gRPC health checks of the ext_proc service every 0.5 s (``HEALTH_UNHEALTHY_THRESHOLD``
    failures in a row eject: a refusing EPP within about 1.5 s; one success restores); with ``tls``
    they go in plain text, the health port having no TLS."""
    check: dict[str, Any] = {
        "timeout": HEALTH_CHECK_TIMEOUT,
        "interval": "0.5s",
        "no_traffic_interval": "0.5s",
        "unhealthy_threshold": HEALTH_UNHEALTHY_THRESHOLD,
        "healthy_threshold": 1,
        "reuse_connection": True,
        "grpc_health_check": {"service_name": EXTPROC_HEALTH_SERVICE},
    }
    if tls:
        # Health checks use the cluster's TLS socket unless a plain-text socket is matched for them.
        cluster["transport_socket_matches"] = [
            {
                "name": "plaintext-health",
                "match": {"epp-health": "plaintext"},
                "transport_socket": {
                    "name": "envoy.transport_sockets.raw_buffer",
                    "typed_config": {"@type": f"{_TYPE}.transport_sockets.raw_buffer.v3.RawBuffer"},
                },
            }
        ]
        check["transport_socket_match_criteria"] = {"epp-health": "plaintext"}
    cluster["health_checks"] = [check]


def _add_health_check(cluster: dict[str, Any], health_port: int, *, tls: bool, host: str = "") -> None:
    """Active gRPC health checks of the EPP on its (plain-text) health port; no panic routing.
    ``host``: check ``host:health_port`` (an endpoint on a Unix socket has no port to replace)."""
    set_health_checks(cluster, tls=tls)
    # 0 %: while the EPP is unhealthy Envoy has no host (no panic routing), so the ext_proc stream
    # fails at once, before any body chunk is sent: fail-open then works in every body mode.
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    for locality in cluster["load_assignment"]["endpoints"]:
        for lb_endpoint in locality["lb_endpoints"]:
            lb_endpoint["endpoint"]["health_check_config"] = (
                {"address": _socket_address(host, health_port)} if host else {"port_value": health_port}
            )


def original_dst_cluster(max_retries: int | None = None) -> dict[str, Any]:
    """ORIGINAL_DST cluster sending each request to the ``ip:port`` in the EPP's destination header."""
    return {
        "name": ORIGINAL_DST_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1000s",
        "circuit_breakers": _circuit_breakers(max_retries),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "typed_extension_protocol_options": engine_protocol_options(),
    }


def engine_protocol_options() -> dict[str, Any]:
    """HTTP/1.1 to the engines, idle connections closed after ``UPSTREAM_IDLE_TIMEOUT``."""
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{_TYPE}.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": UPSTREAM_IDLE_TIMEOUT},
            "explicit_http_config": {"http_protocol_options": {}},
        }
    }


def failover_clusters() -> list[dict[str, Any]]:
    """The fail-over pair: an ORIGINAL_DST cluster reading the EPP's fallback header, and a
    composite cluster whose attempt 1 goes to ``original_destination_cluster`` (the destination
    header) and attempt 2 (the route's one retry) to the fallback. An ORIGINAL_DST cluster alone
    retries to the same address; it cannot walk the GIE endpoint list either (measured on 1.40).
    Without a fallback header (a pool of one) the retry finds no host: 503 ``no healthy upstream``.
    """
    fallback = original_dst_cluster()
    fallback["name"] = FALLBACK_DST_CLUSTER
    fallback["original_dst_lb_config"] = {"use_http_header": True, "http_header_name": FALLBACK_HEADER}
    # Envoy allows 3 concurrent retries per cluster by default: an engine dying under load fails
    # many requests at once, and each must get its retry (measured: the 4th of 4 at once did not).
    fallback["circuit_breakers"] = _circuit_breakers(max_retries=CIRCUIT_BREAKER_LIMIT)
    composite = {
        "name": FAILOVER_CLUSTER,
        "connect_timeout": "1000s",
        "lb_policy": "CLUSTER_PROVIDED",
        "circuit_breakers": _circuit_breakers(max_retries=CIRCUIT_BREAKER_LIMIT),
        "cluster_type": {
            "name": "envoy.clusters.composite",
            "typed_config": {
                "@type": f"{_TYPE}.clusters.composite.v3.ClusterConfig",
                "clusters": [{"name": ORIGINAL_DST_CLUSTER}, {"name": FALLBACK_DST_CLUSTER}],
            },
        },
    }
    return [fallback, composite]


def static_cluster(name: str, endpoints: Sequence[str]) -> dict[str, Any]:
    """A STATIC round-robin cluster over ``"ip:port"`` endpoints (the fail-open fallback)."""
    return {
        "name": name,
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "5s",
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": _load_assignment(name, [split_host_port(e) for e in endpoints]),
        "typed_extension_protocol_options": engine_protocol_options(),
    }


def split_host_port(endpoint: str) -> tuple[str, int]:
    """Split ``"ip:port"`` or ``"[v6]:port"`` into ``(ip, port)``."""
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not ip:port")
    return host.strip("[]"), int(port)


def _circuit_breakers(max_retries: int | None = None) -> dict[str, Any]:
    threshold: dict[str, Any] = {
        "max_connections": CIRCUIT_BREAKER_LIMIT,
        "max_pending_requests": CIRCUIT_BREAKER_LIMIT,
        "max_requests": CIRCUIT_BREAKER_LIMIT,
    }
    if max_retries is not None:
        threshold["max_retries"] = max_retries
    return {"thresholds": [threshold]}


def _load_assignment(name: str, hosts: Sequence[tuple[str, int]]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(h, p)}} for h, p in hosts]}],
    }


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _check_header_mode(field: str, mode: str) -> None:
    if mode not in HEADER_MODES:
        raise ValueError(f"{field} must be SEND or SKIP, got {mode!r}")


def _check_mode(field: str, mode: str) -> None:
    if mode not in BODY_MODES:
        raise ValueError(f"{field} must be one of {', '.join(BODY_MODES)}, got {mode!r}")
