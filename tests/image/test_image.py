"""The built image run as deploy/kubernetes/base runs it (``make image-test``, inside a private
network namespace so the manifests' ports are used as written): its args and ConfigMap, a
read-only root with no writable path, uid 65532, no capabilities, the service-account files of a
fake API server where Kubernetes mounts them. Skipped unless EPP_IMAGE names the image."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.dev.stack import Stack
from epp.dev.stack.probes import grpc_serving
from tests.fakekube import FakeKube, objects
from tests.integration.harness import SIM_ARGS, Response, request

IMAGE = os.environ.get("EPP_IMAGE", "")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not IMAGE or not shutil.which("podman"), reason="make image-test runs these")
NETWORK = f"ns:/run/netns/{os.environ['EPP_NETNS']}" if os.environ.get("EPP_NETNS") else "host"
SA = "/var/run/secrets/kubernetes.io/serviceaccount"
NAMESPACE = "llm"
ENVOY_PORT, ENVOY_ADMIN_PORT = 8081, 19000  # the bootstraps' (the network namespace is private)
REQUESTS = 40
HEALTH_NAMES = ("liveness", "readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor")


def manifest(layout: str, kind: str) -> dict:
    for path in sorted((ROOT / "deploy/kubernetes" / layout).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind:
                return doc
    raise AssertionError(f"no {kind} in deploy/kubernetes/{layout}")


@pytest.fixture(scope="module", autouse=True)
def _in_the_namespace() -> None:
    """This process (and the threads and processes it starts) joins the private network namespace:
    ``ip netns exec`` would also remount /sys, hiding the cgroups podman needs."""
    if not os.environ.get("EPP_NETNS"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{os.environ['EPP_NETNS']}", os.O_RDONLY)
    try:
        assert libc.setns(fd, 0x40000000) == 0, os.strerror(ctypes.get_errno())  # CLONE_NEWNET
    finally:
        os.close(fd)


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(tls=True, bookmark_interval=0.5) as k:
        yield k


def run_container(
    name: str, args: list[str], mounts: dict[str, tuple[Path, bool]], env: dict[str, str]
) -> None:
    cmd = [
        "podman",
        "run",
        "-d",
        "--name",
        name,
        "--network",
        NETWORK,
        "--read-only",
        "--read-only-tmpfs=false",
    ]
    cmd += ["--user", "65532:65532", "--cap-drop=ALL", "--security-opt=no-new-privileges", "--memory=1g"]
    for target, (source, read_only) in mounts.items():
        cmd += ["--volume", f"{source}:{target}" + (":ro" if read_only else "")]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    out = subprocess.run([*cmd, IMAGE, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def container_memory(name: str) -> tuple[int, int]:
    """The container's memory cgroup: bytes in use now and at most so far (v2 memory.current and
    memory.peak; v1 memory.usage_in_bytes and memory.max_usage_in_bytes)."""
    out = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.CgroupPath}}", name], capture_output=True, text=True
    )
    path = out.stdout.strip()
    v2, v1 = Path(f"/sys/fs/cgroup{path}"), Path(f"/sys/fs/cgroup/memory{path}")
    if (v2 / "memory.current").exists():
        return int((v2 / "memory.current").read_text()), int((v2 / "memory.peak").read_text())
    return int((v1 / "memory.usage_in_bytes").read_text()), int(
        (v1 / "memory.max_usage_in_bytes").read_text()
    )


def mb(value: int) -> str:
    return f"{value / 1e6:.0f} MB"


def model_servers(
    stack: Stack, kube: FakeKube, labels: dict[str, str], port: int, model: str
) -> dict[str, str]:
    """Two simulators on their own loopback IPs at the manifests' target port, and a Ready pod for
    each with the pool's labels: pod name -> ip:port."""
    servers = {"vllm-qwen-0": "127.0.0.2", "vllm-qwen-1": "127.0.0.3"}
    children = []
    for pod, ip in servers.items():
        kube.create(objects.pod(NAMESPACE, pod, ip, labels=labels))
        extra = [*SIM_ARGS, "--host", ip, "--namespace", NAMESPACE]
        children.append((stack.start_sim(pod, port, model=model, args=extra), ip))
    for child, ip in children:
        stack.wait_sim(child, f"http://{ip}:{port}")
    return {pod: f"{ip}:{port}" for pod, ip in servers.items()}


def envoy_bootstrap(layout: str, tmp_path: Path, certs: Path, socket_dir: Path) -> dict:
    """standalone: the sidecar's envoy.yaml and SDS files of the manifests with their mount paths
    moved to this test's directories; base: ``epp envoy-config`` with mutual TLS to port 9002."""
    sds = tmp_path / "envoy"
    sds.mkdir()
    if layout == "standalone":
        moves = {
            "/etc/envoy-tls": str(certs / "envoy"),
            "/etc/envoy/": f"{sds}/",
            "/var/run/epp": str(socket_dir),
        }
        for name in ("envoy.yaml", "sds-epp-ca.yaml", "sds-epp-client-certificate.yaml"):
            text = (ROOT / "deploy/kubernetes/standalone" / name).read_text()
            for old, new in moves.items():
                text = text.replace(old, new)
            (sds / name).write_text(text)
        return dict(yaml.safe_load((sds / "envoy.yaml").read_text()))
    cmd = ["epp", "envoy-config", "--tls-cert-dir", str(certs / "envoy"), "--tls-sds-dir", str(sds)]
    out = subprocess.run(
        [*cmd, "--write-sds", str(sds)], capture_output=True, text=True, timeout=60, check=True
    )
    return dict(yaml.safe_load(out.stdout))


def chat(model: str, text: str) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    ).encode()


def post(body: bytes) -> Response:
    headers = {"content-type": "application/json"}
    return request(f"http://127.0.0.1:{ENVOY_PORT}/v1/chat/completions", "POST", body, headers)


def through_envoy(servers: dict[str, str], model: str) -> int:
    """Chat completions through Envoy: each answered by the simulator the EPP named in
    x-gateway-destination-endpoint; a malformed body is the EPP's 400. Returns the requests sent."""
    answered = set()
    for i in range(REQUESTS):
        text = f"image-test {i} {uuid.uuid4().hex} hello"
        resp = post(chat(model, text))
        assert resp.status == 200, resp
        pod = resp.headers.get("x-inference-pod", "")
        assert pod in servers, resp.headers
        assert json.loads(resp.body)["choices"][0]["message"]["content"], resp.body
        journal = request(f"http://{servers[pod]}/debug/requests").json()
        entry = next(e for e in journal if text in e["body"])
        headers = {k.lower(): v for k, v in dict(entry["headers"]).items()}
        assert headers.get("x-gateway-destination-endpoint") == servers[pod], headers
        answered.add(pod)
    bad = post(b'{"model": "' + model.encode() + b'", "messages": [')
    assert bad.status == 400, bad
    assert "inference error: BadRequest" in json.loads(bad.body)["error"]["message"], bad.body
    missing = post(json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode())
    assert missing.status == 400 and b"model" in missing.body, missing
    return REQUESTS + 2


def logs(name: str) -> str:
    out = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=30)
    return out.stdout + out.stderr


def ext_proc_over_socket(socket: Path, certs: Path) -> Any:
    """One ext_proc exchange on the Unix socket, with the sidecar Envoy's client certificate."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    envoy = certs / "envoy"
    credentials = grpc.ssl_channel_credentials(
        (envoy / "ca.crt").read_bytes(), (envoy / "tls.key").read_bytes(), (envoy / "tls.crt").read_bytes()
    )
    headers = [(":method", "GET"), (":path", "/v1/models"), (":authority", "x"), (":scheme", "http")]
    message = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
            ),
            end_of_stream=True,
        )
    )
    override = [("grpc.ssl_target_name_override", "epp")]
    with grpc.secure_channel(f"unix:{socket}", credentials, override) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        return next(iter(stub.Process(iter([message]), timeout=10)))


@pytest.mark.parametrize("layout", ["base", "standalone"])
def test_layout_serves_health_metrics_and_stops_cleanly_on_sigterm(
    kube: FakeKube, tmp_path: Path, layout: str
) -> None:
    deployment = manifest(layout, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    config = manifest(layout, "ConfigMap")["data"]
    (tmp_path / "config").mkdir()
    for key, text in config.items():
        (tmp_path / "config" / key).write_text(text)
    certs = tmp_path / "certs"
    subprocess.run(["epp", "certs", "--out", str(certs)], check=True, capture_output=True, timeout=60)
    sa = tmp_path / "sa"
    kube.write_incluster_files(sa)
    (sa / "namespace").write_text(NAMESPACE)
    for p in (tmp_path, *tmp_path.rglob("*")):  # readable by uid 65532
        p.chmod(0o755 if p.is_dir() else 0o644)
    pool = manifest("inferencepool", "InferencePool")
    pool["metadata"]["namespace"] = NAMESPACE
    kube.create(pool)
    labels = pool["spec"]["selector"]["matchLabels"]
    assert layout == "base" or f"--endpoint-selector=app={labels['app']}" in container["args"]
    port = pool["spec"]["targetPorts"][0]["number"]
    assert layout == "base" or f"--endpoint-target-ports={port}" in container["args"]
    vllm = manifest("vllm", "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    model = next(a.split("=", 1)[1] for a in vllm if a.startswith("--model="))
    stack = Stack(tmp_path / "stack")
    servers = model_servers(stack, kube, labels, port, model)
    (tmp_path / "socket").mkdir()
    (tmp_path / "socket").chmod(0o777)  # the emptyDir, writable by the pod's uid
    volumes = {"config": tmp_path / "config", "tls": certs / "epp", "epp-socket": tmp_path / "socket"}
    mounts = {
        m["mountPath"]: (volumes[m["name"]], bool(m.get("readOnly"))) for m in container["volumeMounts"]
    }
    mounts[SA] = (sa, True)
    env = {
        "NAMESPACE": NAMESPACE,
        "POD_NAME": "epp-0",
        "POD_IP": "127.0.0.1",
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(kube.port),
    }
    name = f"epp-image-test-{os.getpid()}"
    start = time.monotonic()
    try:
        run_container(name, container["args"], mounts, env)
        health = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc-health")
        metrics = next(p["containerPort"] for p in container["ports"] if p["name"] == "http-metrics")
        deadline = start + 60
        while not grpc_serving(health, "readiness"):
            assert time.monotonic() < deadline, logs(name)
            time.sleep(0.1)
        ready = time.monotonic() - start
        at_ready = container_memory(name)
        print(f"image-test: {layout} layout ready {ready:.2f} s after podman run, memory {mb(at_ready[0])}")
        for service in HEALTH_NAMES:
            assert grpc_serving(health, service), service
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            assert r.status == 200 and b"llm_d_epp" in r.read()
        socket_arg = next((a for a in container["args"] if a.startswith("--grpc-socket=")), None)
        if socket_arg:  # the sidecar Envoy's way in: mutual TLS on the Unix socket of the emptyDir
            socket = tmp_path / "socket" / Path(socket_arg.split("=", 1)[1]).name
            reply = ext_proc_over_socket(socket, certs)
            assert reply.HasField("request_headers") or reply.HasField("immediate_response"), reply
        bootstrap = envoy_bootstrap(layout, tmp_path, certs, tmp_path / "socket")
        envoy = stack.start_envoy("envoy", bootstrap, log_level="warning", concurrency=1)
        stack.wait_envoy(envoy, ENVOY_ADMIN_PORT)
        sent = through_envoy(servers, model)
        now, peak = container_memory(name)
        print(f"image-test: {layout} memory after {sent} requests through Envoy {mb(now)} (peak {mb(peak)})")
        stop = time.monotonic()
        subprocess.run(["podman", "kill", "--signal", "TERM", name], check=True, timeout=30)
        code = subprocess.run(["podman", "wait", name], capture_output=True, text=True, timeout=60)
        print(f"image-test: SIGTERM to exit {time.monotonic() - stop:.2f} s")
        text = logs(name)
        assert code.stdout.strip() == "0", text
        assert "Traceback" not in text and "Read-only file system" not in text, text
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=60)
        stack.stop()
