"""The EPP container of the llm-d Helm charts, with epp's image swapped in and nothing else changed.

The args, ports, probes and env below are rendered by hand from the llm-d router's Helm library
chart of router v0.11 (its EPP deployment pod spec) with its default values (release ``qwen`` in
namespace ``llm``), for three value sets: the ``llm-d-router-gateway`` chart as installed, the same with
``router.epp.replicas: 2``, ``router.tracing.enabled: true``, ``router.epp.flags`` and
``router.monitoring.prometheus.auth.enabled: false``, and the ``llm-d-router-standalone`` chart with
``router.inferencePool.create: false``. Each runs the real ``epp serve`` with exactly those args
and env, against the in-process fake API server, and checks what the kubelet and the Gateway would:
the probes' gRPC health services answer SERVING once the pool is synced (and not before), the
container ports 9002 (ext_proc), 9003 (health) and 9090 (metrics) listen, and a request routes.

What differs from a pod, because nothing here is a cluster: ``KUBECONFIG`` points at the fake API
server (a pod uses its service-account mount, which the chart does not configure either), and the
``--config-file`` path, the ConfigMap's ``/config`` mount, is a temporary directory holding the
chart's ``default-plugins.yaml`` (its config template with the defaults: vllm over http, no
parsers). The model-server target port is a free one (``router.modelServers.
targetPorts``), as the chart's 8000 may be taken on this machine. The chart's ports are fixed, so
the test needs 9002, 9003 and 9090 free.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from epp.dev import stack
from tests.fakekube import FakeKube, objects
from tests.integration.harness import Rig, chat_body, marker
from tests.unit.extproc_harness import body_msg, headers_msg

pytestmark = pytest.mark.integration

RELEASE, NAMESPACE = "qwen", "llm"
POD_NAME = "qwen-epp-7d9c8b6f5-x2x7q"  # the Deployment "qwen-epp"'s pod (metadata.name)
CONTAINER_PORTS = {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}  # the chart's containerPorts
HEALTH_PORT = CONTAINER_PORTS["grpc-health"]
POD_IP = "127.0.0.71"
SELECTOR = {"app": "vllm-qwen"}  # router.modelServers.matchLabels
TRACEPARENT_TRACE = "0af7651916cd43dd8448eb211c80319c"

# router.epp.pluginsConfigFile: default-plugins.yaml, as the chart's ConfigMap renders it.
DEFAULT_PLUGINS = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
    insecureSkipVerify: true
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""

# Container env of every variant: the downward API values the kubelet fills in.
CHART_ENV = {"NAMESPACE": NAMESPACE, "POD_NAME": POD_NAME}


@dataclass(frozen=True)
class Variant:
    """One rendered container: ``args`` (``{config}`` and ``{port}`` filled in by the test),
    the probes' gRPC services, env beyond :data:`CHART_ENV`, and whether an InferencePool exists."""

    name: str
    args: tuple[str, ...]
    liveness_service: str
    readiness_service: str
    env: dict[str, str] = field(default_factory=dict)
    pool: bool = True
    tracing: bool = False
    metrics_token: str = ""  # with --metrics-endpoint-auth: Prometheus's token


# The args every InferencePool-mode rendering starts with (the gateway chart's template order).
_POOL_ARGS = (
    "--pool-name",
    RELEASE,
    "--pool-namespace",
    NAMESPACE,
    "--pool-group",
    "inference.networking.k8s.io",
    "--zap-encoder",
    "json",
    "--config-file",
    "{config}/default-plugins.yaml",
)

GATEWAY = Variant(
    "gateway-defaults",
    # llm-d-router-gateway, default values: InferencePool mode, one replica, tracing and the
    # metrics auth flag at their defaults.
    (
        *_POOL_ARGS,
        "--grpc-health-port",
        "9003",
        "--tracing=false",
    ),
    liveness_service="inference-extension",
    readiness_service="inference-extension",
)

GATEWAY_HA_TRACING = Variant(
    "gateway-ha-tracing",
    # router.epp.replicas: 2 (leader election, named probes), router.epp.flags {v: 2,
    # drain-timeout: 5s, and router v0.11's feature-gates and plugin-state-staleness-threshold}
    # (rendered in key order as --key=value), router.tracing.enabled: true
    # (otelExporterEndpoint set to the test's collector), router.monitoring.prometheus.auth.enabled:
    # false.
    (
        *_POOL_ARGS,
        "--ha-enable-leader-election",
        "--grpc-health-port",
        "9003",
        "--drain-timeout=5s",
        "--feature-gates=haPopulateNonLeaderDatastore=true",
        "--plugin-state-staleness-threshold=5m",
        "--v=2",
        "--tracing=true",
        "--metrics-endpoint-auth=false",
    ),
    liveness_service="liveness",
    readiness_service="readiness",
    env={
        "OTEL_SERVICE_NAME": "llm-d-router/epp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "{otlp}",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_RESOURCE_ATTRIBUTES_NODE_NAME": "node-1",
        "OTEL_RESOURCE_ATTRIBUTES_POD_NAME": POD_NAME,
        # $(VAR) references expanded as the kubelet does
        "OTEL_RESOURCE_ATTRIBUTES": (
            f"k8s.namespace.name={NAMESPACE},k8s.node.name=node-1,k8s.pod.name={POD_NAME}"
        ),
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
    },
    tracing=True,
)

GATEWAY_METRICS_AUTH = Variant(
    "gateway-metrics-auth",
    # router.epp.flags {metrics-endpoint-auth: true} with router.monitoring.prometheus.enabled: true
    # (the chart's ClusterRole lets the EPP create TokenReviews and SubjectAccessReviews, and the
    # ServiceMonitor scrapes with a service-account token)
    (
        *_POOL_ARGS,
        "--grpc-health-port",
        "9003",
        "--metrics-endpoint-auth=true",
        "--tracing=false",
    ),
    liveness_service="inference-extension",
    readiness_service="inference-extension",
    metrics_token="prometheus-sa-token",
)

STANDALONE = Variant(
    "standalone",
    # llm-d-router-standalone with router.inferencePool.create: false: the selector is rendered from
    # router.modelServers.matchLabels, the ports from router.modelServers.targetPorts.
    (
        "--endpoint-selector",
        "app=vllm-qwen",
        "--endpoint-target-ports",
        "{port}",
        "--zap-encoder",
        "json",
        "--config-file",
        "{config}/default-plugins.yaml",
        "--grpc-health-port",
        "9003",
        "--tracing=false",
    ),
    liveness_service="inference-extension",
    readiness_service="inference-extension",
    pool=False,
)


def _chart_inference_pool(target_port: int) -> dict[str, Any]:
    """The InferencePool the chart renders (protocol http)."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": RELEASE,
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/name": f"{RELEASE}-epp", "app.kubernetes.io/version": "0.0.0"},
        },
        "spec": {
            "targetPorts": [{"number": target_port}],
            "appProtocol": "http",
            "selector": {"matchLabels": SELECTOR},
            "endpointPickerRef": {
                "name": f"{RELEASE}-epp",
                "port": {"number": 9002},
                "failureMode": "FailOpen",
            },
        },
    }


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _health(service: str) -> int | None:
    """The status the kubelet's gRPC probe gets for ``service``; None when it cannot connect."""
    with grpc.insecure_channel(f"127.0.0.1:{HEALTH_PORT}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError as e:
            return -1 if e.code() == grpc.StatusCode.NOT_FOUND else None
        return int(reply.status)


def _wait(check: Any, what: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise AssertionError(
                f"epp exited ({proc.returncode}) waiting for {what}:\n{log.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


def _server_certificate(port: int) -> bytes:
    """The ext_proc listener's (self-signed) certificate, as PEM."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


def _route(traceparent: str) -> str:
    """One chat request over ext_proc (TLS, as a Gateway sends it); the destination picked."""
    port = CONTAINER_PORTS["grpc"]
    credentials = grpc.ssl_channel_credentials(root_certificates=_server_certificate(port))
    options = [("grpc.ssl_target_name_override", "epp")]
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        messages = [headers_msg({"traceparent": traceparent}), body_msg(chat_body(marker()), True)]
        replies = stub.Process(iter(messages), timeout=10)
        first = next(replies)
    mutation = first.request_headers.response.header_mutation
    headers = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
    return headers["x-gateway-destination-endpoint"]


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, str], Any]] = []

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        for rs in request.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            self.spans.extend((resource, s) for ss in rs.scope_spans for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=0.5) as k:
        yield k


@pytest.fixture
def collector() -> Iterator[tuple[_Collector, int]]:
    c = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield c, port
    server.stop(0)


@pytest.mark.parametrize(
    "variant", [GATEWAY, GATEWAY_HA_TRACING, GATEWAY_METRICS_AUTH, STANDALONE], ids=lambda v: v.name
)
def test_epp_runs_with_the_helm_charts_args_probes_ports_and_env(
    variant: Variant,
    rig: Rig,
    kube: FakeKube,
    collector: tuple[_Collector, int],
    tmp_path: Path,
) -> None:
    busy = [port for port in CONTAINER_PORTS.values() if _listening(port)]
    assert not busy, f"the chart's container ports {busy} are taken on this machine"
    target_port = stack.free_port()
    (sim,) = rig.start_sims(1, prefix="vllm-qwen", hosts=[POD_IP], port=target_port)
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "default-plugins.yaml").write_text(DEFAULT_PLUGINS)
    args = [a.format(config=config_dir, port=target_port) for a in variant.args]
    env = {k: v.format(otlp=f"http://127.0.0.1:{collector[1]}") for k, v in variant.env.items()}
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)
    kube.create(objects.pod(NAMESPACE, "vllm-qwen-0", POD_IP, labels=SELECTOR))
    log = tmp_path / "epp.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp", "serve", *args],
        env={**os.environ, **CHART_ENV, **env, "KUBECONFIG": str(kubeconfig)},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        _wait(lambda: _health("liveness") == health_pb2.HealthCheckResponse.SERVING, "liveness", proc, log)
        if variant.pool:
            # the InferencePool is not there yet: the probes' services say NOT_SERVING
            for service in {variant.readiness_service, ""}:
                assert _health(service) == health_pb2.HealthCheckResponse.NOT_SERVING, service
            kube.create(_chart_inference_pool(target_port))
        for service in (variant.readiness_service, variant.liveness_service, ""):
            _wait(
                lambda s=service: _health(s) == health_pb2.HealthCheckResponse.SERVING,  # type: ignore[misc]
                f"gRPC health {service!r} SERVING",
                proc,
                log,
            )
        for name, port in CONTAINER_PORTS.items():
            assert _listening(port), f"container port {name} ({port}) is not listening"
        metrics_url = f"http://127.0.0.1:{CONTAINER_PORTS['metrics']}/metrics"
        headers = {}
        if variant.metrics_token:
            prometheus = "system:serviceaccount:monitoring:prometheus"
            kube.add_user(variant.metrics_token, prometheus)
            kube.grant_non_resource(prometheus, "get", "/metrics")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(metrics_url, timeout=15)
            assert refused.value.code == 401
            headers = {"Authorization": f"Bearer {variant.metrics_token}"}
        with urllib.request.urlopen(urllib.request.Request(metrics_url, headers=headers), timeout=15) as r:
            assert r.status == 200 and b"inference_pool_average_queue_size" in r.read()
        trace_id = TRACEPARENT_TRACE
        assert _route(f"00-{trace_id}-b7ad6b7169203331-01") == sim.address
        if variant.tracing:
            # spans are exported in batches (every 5 s by default): wait for the request's
            _wait(
                lambda: any(s.name == "gateway.request" for _, s in collector[0].spans),
                "the request's spans at the OTLP collector",
                proc,
                log,
            )
            resource, span = next((r, s) for r, s in collector[0].spans if s.name == "gateway.request")
            assert span.trace_id.hex() == trace_id
            assert resource["service.name"] == "llm-d-router/epp" and resource["k8s.pod.name"] == POD_NAME
        else:
            assert collector[0].spans == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "Traceback" not in text and '"level": "error"' not in text, text[-4000:]
    assert "flag accepted but not honoured" not in text, text[-4000:]
    # without the flag /metrics is open (the reference would require a token): said once
    unauthenticated = text.count("/metrics is served without authentication")
    explicit = any(a.startswith("--metrics-endpoint-auth=") for a in args)
    assert unauthenticated == (0 if explicit else 1), text[-4000:]
