"""Authenticated TLS between a real Envoy and the real ``epp serve``, with certificates from ``epp certs``.

Envoy verifies the EPP's certificate (CA and name) and presents its own; the EPP requires a client
certificate signed by its CA (``--grpc-client-ca-file``). Certificates are laid out as Kubernetes
mounts a Secret (files that are symlinks into ``..data``, swapped atomically on renewal), so the
renewal tests exercise what a cert-manager rotation does. The replication port of a real leader serves
only peers presenting a replica's certificate.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from epp.server.replication import METHOD
from epp.server.tls import REPLICA_NAME, Authority, KeyPair
from tests.fakekube import FakeKube, objects
from tests.integration.harness import Envoy, Epp, Rig, chat_body, marker
from tests.integration.test_kubernetes import HA, NS, kube_args

pytestmark = pytest.mark.integration

FILES = ("tls.crt", "tls.key", "ca.crt")


class SecretDir:
    """A directory laid out like a mounted Secret: ``tls.crt -> ..data/tls.crt``, ``..data -> ..vN``."""

    def __init__(self, path: Path, pair: KeyPair) -> None:
        self.path = path
        self.version = 0
        path.mkdir(parents=True)
        self.update(pair)
        for name in FILES:
            (path / name).symlink_to(f"..data/{name}")

    def update(self, pair: KeyPair) -> None:
        self.version += 1
        version = self.path / f"..v{self.version}"
        version.mkdir()
        for name, data in zip(FILES, (pair.cert, pair.key, pair.ca or b""), strict=True):
            (version / name).write_bytes(data)
        tmp = self.path / "..data_tmp"
        tmp.symlink_to(version.name)
        os.replace(tmp, self.path / "..data")  # atomic, as the kubelet does


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``epp certs`` output: ca.crt, epp/ (server + client) and envoy/ (client)."""
    out = tmp_path_factory.mktemp("certs") / "out"
    result = subprocess.run(
        [sys.executable, "-m", "epp", "certs", "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "kubectl -n NAMESPACE create secret generic epp-tls" in result.stdout
    return out


def _pair(directory: Path) -> KeyPair:
    return KeyPair(*(Path(directory, f).read_bytes() for f in ("tls.key", "tls.crt", "ca.crt")))


def _epp_args(cert_dir: Path, client_ca: Path | None, *extra: str) -> list[str]:
    args = ["--secure-serving=true", f"--cert-path={cert_dir}", *extra]
    return args + ([f"--grpc-client-ca-file={client_ca}"] if client_ca is not None else [])


def _start_envoy(rig: Rig, epp: Epp, cert_dir: Path, name: str, *, wait: bool = True) -> Envoy:
    sds_dir = rig.log_dir / f"{name}-sds"
    sds_dir.mkdir()
    tls = envoy_config.EppTls(str(cert_dir), str(sds_dir), server_name="epp")
    for file, doc in envoy_config.sds_files(tls).items():
        (sds_dir / file).write_text(envoy_config.render(doc))
    return rig.start_envoy(epp, name=name, tls=tls, wait_for_traffic=wait)


def _routes(envoy: Envoy, rig: Rig) -> bool:
    m = marker()
    resp = envoy.post("/v1/chat/completions", chat_body(m))
    return resp.status == 200 and any(s.find(m) for s in rig.sims if s.port == resp.port)


def _refused(envoy: Envoy, rig: Rig) -> None:
    """Every request fails (500, the ext_proc stream cannot be opened) and reaches no model server."""
    markers = []
    for _ in range(3):
        m = marker()
        markers.append(m)
        resp = envoy.post("/v1/chat/completions", chat_body(m))
        assert resp.status == 500, (resp.status, resp.body[:200])
    assert not any(s.find(m) for s in rig.sims for m in markers)


def test_envoy_and_the_epp_authenticate_each_other(rig: Rig, ca: Path) -> None:
    sims = rig.start_sims(2)
    epp = rig.start_epp(sims, extra=_epp_args(ca / "epp", ca / "ca.crt"))
    envoy = _start_envoy(rig, epp, ca / "envoy", "envoy-mtls")
    for _ in range(4):
        assert _routes(envoy, rig)
    assert envoy.stat("cluster.ext_proc.ssl.handshake") >= 1
    assert envoy.stat("cluster.ext_proc.ssl.fail_verify_error") == 0


def test_the_epp_refuses_an_envoy_with_a_certificate_from_another_ca(
    rig: Rig, ca: Path, tmp_path: Path
) -> None:
    sims = rig.start_sims(1)
    epp = rig.start_epp(sims, extra=_epp_args(ca / "epp", ca / "ca.crt"))
    stranger = Authority.create("other").issue("envoy", server=False, client=True)
    # Envoy trusts the EPP's CA, but its own certificate comes from elsewhere.
    envoy_dir = SecretDir(
        tmp_path / "envoy", KeyPair(stranger.key, stranger.cert, (ca / "ca.crt").read_bytes())
    )
    envoy = _start_envoy(rig, epp, envoy_dir.path, "envoy-stranger", wait=False)
    _refused(envoy, rig)
    # ... and one without any client certificate
    bare = rig.log_dir / "bare-sds"
    bare.mkdir()
    tls = envoy_config.EppTls(str(ca / "envoy"), str(bare), client_certificate=False)
    for file, doc in envoy_config.sds_files(tls).items():
        (bare / file).write_text(envoy_config.render(doc))
    _refused(rig.start_envoy(epp, name="envoy-no-cert", tls=tls, wait_for_traffic=False), rig)


def test_envoy_refuses_an_epp_it_cannot_verify(rig: Rig, ca: Path, tmp_path: Path) -> None:
    sims = rig.start_sims(1)
    # the EPP's default self-signed certificate (the reference default): not signed by Envoy's CA
    self_signed = rig.start_epp(sims, name="epp-self-signed", extra=["--secure-serving=true"])
    envoy = _start_envoy(rig, self_signed, ca / "envoy", "envoy-self-signed", wait=False)
    _refused(envoy, rig)
    assert envoy.stat("cluster.ext_proc.ssl.fail_verify_error") >= 1
    # signed by the right CA but for another name: Envoy checks the name, too
    authority = Authority(*(Path(ca, f).read_bytes() for f in ("ca.key", "ca.crt")))
    wrong = SecretDir(
        tmp_path / "wrong", authority.issue("model-server", dns_names=["model-server"], client=True)
    )
    impostor = rig.start_epp(sims, name="epp-wrong-name", extra=_epp_args(wrong.path, None))
    envoy = _start_envoy(rig, impostor, ca / "envoy", "envoy-wrong-name", wait=False)
    _refused(envoy, rig)
    assert envoy.stat("cluster.ext_proc.ssl.fail_verify_san") >= 1


def _served_certificate(port: int, client: Path) -> bytes:
    """The DER certificate the EPP presents on a new TLS connection (as a client with ``client``)."""
    context = ssl.create_default_context(cafile=str(client / "ca.crt"))
    context.check_hostname = False
    context.load_cert_chain(str(client / "tls.crt"), str(client / "tls.key"))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="epp") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der


def _der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


def test_the_epp_serves_a_renewed_certificate_without_a_restart(rig: Rig, ca: Path, tmp_path: Path) -> None:
    authority = Authority(*(Path(ca, f).read_bytes() for f in ("ca.key", "ca.crt")))
    first = authority.issue("epp", dns_names=["epp"], client=True)
    secret = SecretDir(tmp_path / "epp", first)
    sims = rig.start_sims(1)
    epp = rig.start_epp(sims, extra=_epp_args(secret.path, secret.path / "ca.crt", "--enable-cert-reload"))
    envoy = _start_envoy(rig, epp, ca / "envoy", "envoy-renewal")
    assert _served_certificate(epp.grpc_port, ca / "envoy") == _der(first.cert)

    renewed = authority.issue("epp", dns_names=["epp"], client=True)
    secret.update(renewed)
    stack.wait_until(
        "the renewed certificate on a new connection",
        lambda: _served_certificate(epp.grpc_port, ca / "envoy") == _der(renewed.cert),
        timeout=30,
        children=[epp.child],
    )
    assert epp.child.running()
    assert _routes(envoy, rig)  # Envoy's connection, opened before, still works


def test_envoy_picks_up_a_renewed_client_certificate(rig: Rig, ca: Path, tmp_path: Path) -> None:
    """Envoy starts with a client certificate the EPP refuses; the Secret is renewed with a good one,
    and Envoy (file SDS watching the directory) uses it without a restart."""
    sims = rig.start_sims(1)
    epp = rig.start_epp(sims, extra=_epp_args(ca / "epp", ca / "ca.crt"))
    stranger = Authority.create("other").issue("envoy", server=False, client=True)
    envoy_dir = SecretDir(
        tmp_path / "envoy", KeyPair(stranger.key, stranger.cert, (ca / "ca.crt").read_bytes())
    )
    envoy = _start_envoy(rig, epp, envoy_dir.path, "envoy-rotating", wait=False)
    _refused(envoy, rig)
    envoy_dir.update(_pair(ca / "envoy"))
    deadline = time.monotonic() + 30
    while not _routes(envoy, rig):
        assert time.monotonic() < deadline, "Envoy did not pick up the renewed client certificate"
        time.sleep(0.5)
    assert envoy.child.running()


# --------------------------------------------------------------------- the replication port


def _credentials(ca: Path, client: Path | None) -> grpc.ChannelCredentials:
    """TLS trusting ``ca``'s CA, presenting ``client``'s key pair (none: no client certificate)."""
    if client is None:
        return grpc.ssl_channel_credentials((ca / "ca.crt").read_bytes())
    pair = _pair(client)
    return grpc.ssl_channel_credentials(pair.ca, private_key=pair.key, certificate_chain=pair.cert)


def _first_message(port: int, credentials: grpc.ChannelCredentials | None) -> bytes:
    """The first message of the replication stream ``Follow`` on 127.0.0.1:``port``."""
    address = f"127.0.0.1:{port}"
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(
            address, credentials, options=[("grpc.ssl_target_name_override", REPLICA_NAME)]
        )
    )
    with channel:
        call = channel.unary_stream(METHOD)(b"", timeout=10)
        try:
            return bytes(next(call))
        finally:
            call.cancel()


def test_a_leaders_replication_port_serves_replicas_only(rig: Rig, ca: Path, tmp_path: Path) -> None:
    with FakeKube(bookmark_interval=0.5) as kube:
        (sim,) = rig.start_sims(1, prefix="pod", hosts=["127.0.0.11"], port=stack.free_port())
        kube.create(objects.inference_pool(NS, (sim.port,)))
        kube.create(objects.pod(NS, sim.name, sim.host, ready=True))
        replication_port = stack.free_port()
        extra = kube_args(kube, tmp_path, "--pool-name", "pool", *HA, "--ha-retry-period=0.2s")
        extra += [f"--ha-replication-port={replication_port}", f"--ha-replication-cert-path={ca / 'epp'}"]
        epp = rig.start_epp([], name="epp-leader", file_discovery=False, extra=extra)  # Ready: it leads

        # a replica's certificate (the EPP's own Secret): served, starting with a reset
        assert json.loads(_first_message(replication_port, _credentials(ca, ca / "epp"))) == {"$reset": True}
        refusals = (
            (None, grpc.StatusCode.UNAVAILABLE),  # plain text
            (_credentials(ca, None), grpc.StatusCode.UNAVAILABLE),  # TLS without a client certificate
            (_credentials(ca, ca / "envoy"), grpc.StatusCode.PERMISSION_DENIED),  # same CA, not a replica
        )
        for credentials, code in refusals:
            with pytest.raises(grpc.RpcError) as err:
                _first_message(replication_port, credentials)
            assert err.value.code() == code  # type: ignore[attr-defined]
        # the health port (plain text, for the kubelet's probes) does not serve the stream at all
        with pytest.raises(grpc.RpcError) as err:
            _first_message(epp.health_port, None)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
        assert stack.grpc_serving(epp.health_port)
