"""TLS material: ``epp certs``, start-up checks of certificate files, and certificate reload."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from epp.server.tls import Authority, KeyPair, server_credentials


def epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epp", *args], capture_output=True, text=True, timeout=60)


def _write(directory: Path, pair: KeyPair) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in (("tls.crt", pair.cert), ("tls.key", pair.key), ("ca.crt", pair.ca or b"")):
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(directory / name)
    return directory


def test_epp_certs_writes_a_ca_and_verifiable_pairs(tmp_path: Path) -> None:
    from cryptography import x509

    out = epp("certs", "--out", str(tmp_path / "c"), "--dns-name", "epp.llm.svc", "--days", "30")
    assert out.returncode == 0, out.stderr
    assert "create secret generic epp-tls" in out.stdout and "epp-envoy-tls" in out.stdout
    ca = x509.load_pem_x509_certificate((tmp_path / "c" / "ca.crt").read_bytes())
    for name in ("epp", "envoy"):
        cert = x509.load_pem_x509_certificate((tmp_path / "c" / name / "tls.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert (tmp_path / "c" / name / "ca.crt").read_bytes() == (tmp_path / "c" / "ca.crt").read_bytes()
        assert (tmp_path / "c" / name / "tls.key").stat().st_mode & 0o077 == 0
    san = x509.load_pem_x509_certificate((tmp_path / "c" / "epp" / "tls.crt").read_bytes()).extensions
    names = san.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"epp", "epp-replica", "localhost", "epp.llm.svc"} <= set(names)
    # never overwrites a CA (its key signs everything the cluster trusts)
    again = epp("certs", "--out", str(tmp_path / "c"))
    assert again.returncode == 2 and "would overwrite" in again.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grpc-client-ca-file=/x/ca.crt"], "--grpc-client-ca-file needs --secure-serving and --cert-path"),
        (["--cert-path={missing}"], "error: --cert-path: {missing}/tls.key:"),
        (["--cert-path={mismatched}"], "tls.key does not match tls.crt"),
        (["--cert-path={good}", "--grpc-client-ca-file={good}/nope.pem"], "nope.pem"),
        (
            ["--secure-serving=false", "--ha-replication-cert-path={noca}"],
            "--ha-replication-cert-path: {noca}/ca.crt",
        ),
    ],
)
def test_serve_refuses_unusable_tls_files_with_the_file_and_reason(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    ca = Authority.create()
    good, other = ca.issue("epp"), ca.issue("epp")
    dirs = {
        "missing": tmp_path / "missing",
        "good": _write(tmp_path / "good", good),
        "mismatched": _write(tmp_path / "mismatched", KeyPair(other.key, good.cert, good.ca)),
        "noca": _write(tmp_path / "noca", good),
    }
    (dirs["noca"] / "ca.crt").unlink()
    out = epp("serve", *(f.format(**dirs) for f in flags), "--config-text", "", "--pool-name", "p")
    assert out.returncode != 0
    assert message.format(**dirs) in out.stderr, out.stderr


def _served(port: int) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as conn:
        der = conn.getpeercert(binary_form=True)
        assert der is not None
        return der


def _der(pair: KeyPair) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pair.cert.decode())


async def _until_served(port: int, pair: KeyPair, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while await asyncio.to_thread(_served, port) != _der(pair):
        assert asyncio.get_running_loop().time() < deadline, "the renewed certificate was not served"
        await asyncio.sleep(0.2)


async def test_reload_serves_a_renewed_pair_and_ignores_a_half_written_one(tmp_path: Path) -> None:
    ca = Authority.create()
    first, second, third = ca.issue("epp"), ca.issue("epp"), ca.issue("epp")
    directory = _write(tmp_path / "tls", first)
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", server_credentials(str(directory), reload=True))
    await server.start()
    try:
        assert await asyncio.to_thread(_served, port) == _der(first)
        _write(directory, second)
        await _until_served(port, second)
        # mid-renewal: the new certificate is there, its key not yet; the current pair stays
        (directory / "tls.crt").write_bytes(third.cert)
        await asyncio.sleep(1.5)  # past the reload interval: the files were looked at
        for _ in range(3):
            assert await asyncio.to_thread(_served, port) == _der(second)
        (directory / "tls.key").write_bytes(third.key)
        await _until_served(port, third)
    finally:
        await server.stop(0)


async def test_without_reload_the_first_pair_stays(tmp_path: Path) -> None:
    ca = Authority.create()
    first, second = ca.issue("epp"), ca.issue("epp")
    directory = _write(tmp_path / "tls", first)
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", server_credentials(str(directory)))
    await server.start()
    try:
        _write(directory, second)
        await asyncio.sleep(1.5)
        assert await asyncio.to_thread(_served, port) == _der(first)
    finally:
        await server.stop(0)


async def _served_by(context: ssl.SSLContext) -> tuple[asyncio.Server, int]:
    async def close(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(close, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


async def test_own_server_tls_starts_and_renews_with_no_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only root has no writable /tmp: the key pairs (self-signed at start, mounted files and
    their renewal) are loaded without writing a file anywhere."""
    import tempfile

    from epp.server.tls import server_ssl_context

    ca = Authority.create()
    first, second = ca.issue("epp"), ca.issue("epp")
    directory = _write(tmp_path / "tls", first)
    unusable = tmp_path / "no-tmp"  # does not exist: every temporary file or directory fails
    monkeypatch.setenv("TMPDIR", str(unusable))
    monkeypatch.setattr(tempfile, "tempdir", str(unusable))

    self_signed, port = await _served_by(server_ssl_context(None))
    try:
        served = await asyncio.to_thread(_served, port)
        assert b"epp" in served
    finally:
        self_signed.close()
    renewing, port = await _served_by(server_ssl_context(str(directory), reload=True))
    try:
        assert await asyncio.to_thread(_served, port) == _der(first)
        _write(directory, second)
        before = sorted(p.name for p in tmp_path.rglob("*"))
        await _until_served(port, second)
    finally:
        renewing.close()
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
