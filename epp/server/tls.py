"""TLS material for the EPP's gRPC servers and the replication client."""

from __future__ import annotations

import datetime
import os
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

log = structlog.get_logger("epp.tls")

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_FILE = "ca.crt"
# The DNS name a replica's certificate carries: peers check it in both directions, so a client
# certificate from the same CA without it (Envoy's) cannot follow the leader.
REPLICA_NAME = "epp-replica"
RELOAD_INTERVAL = 1.0  # a renewed certificate is noticed within this long of the next handshake


class TlsFileError(Exception):
    """A key pair or CA file that cannot be used (the path and the reason)."""


def self_signed_pem(common_name: str = "epp") -> tuple[bytes, bytes]:
    """A fresh EC key and self-signed certificate, as PEM ``(key, cert)``."""
    from cryptography.hazmat.primitives import hashes

    key = _new_key()
    name = _name(common_name)
    cert = _builder(name, name, key, days=3650).sign(key, hashes.SHA256())
    return _key_pem(key), _cert_pem(cert)


# ------------------------------------------------------------------------------------ files


@dataclass(frozen=True, slots=True)
class KeyPair:
    key: bytes
    cert: bytes
    ca: bytes | None = None


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TlsFileError(f"{path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise TlsFileError(f"{path}: not a PEM file")
    return data


def _check_pair(pair: KeyPair, where: str) -> None:
    """The key belongs to the certificate (a half-renewed pair would fail every handshake)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(pair.cert)
        key = serialization.load_pem_private_key(pair.key, password=None)
        if pair.ca is not None:
            x509.load_pem_x509_certificates(pair.ca)
    except ValueError as e:
        raise TlsFileError(f"{where}: {e}") from None
    pub = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*pub) != key.public_key().public_bytes(*pub):
        raise TlsFileError(f"{where}: {KEY_FILE} does not match {CERT_FILE}")


class CertificateFiles:
    """``tls.crt``/``tls.key`` in ``directory`` and an optional CA file, read and checked together.

    ``changed()`` is cheap (three ``stat`` calls, at most once per ``interval``): Kubernetes
    renews a mounted Secret by swapping a symlink, which changes the inode of every file.
    """

    def __init__(self, directory: str | Path, ca_file: str | Path | None = None, *, interval: float = 0.0):
        self.directory = Path(directory)
        self.ca_file = Path(ca_file) if ca_file else None
        self.interval = interval
        self._signature: tuple[tuple[int, int, int], ...] | None = None
        self._checked = 0.0

    @property
    def paths(self) -> tuple[Path, ...]:
        base = (self.directory / CERT_FILE, self.directory / KEY_FILE)
        return base if self.ca_file is None else (*base, self.ca_file)

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                out.append((0, 0, 0))
            else:
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def load(self) -> KeyPair:
        """Read and check the files now; ``TlsFileError`` names the file and the problem."""
        signature = self._stat()
        pair = KeyPair(
            key=_read(self.directory / KEY_FILE),
            cert=_read(self.directory / CERT_FILE),
            ca=_read(self.ca_file) if self.ca_file is not None else None,
        )
        _check_pair(pair, str(self.directory))
        self._signature = signature
        return pair

    def changed(self) -> bool:
        now = time.monotonic()
        if now - self._checked < self.interval:
            return False
        self._checked = now
        return self._stat() != self._signature


def _server_config(pair: KeyPair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pair.key, pair.cert)], root_certificates=pair.ca)


def _renewed(files: CertificateFiles) -> KeyPair | None:
    """The files' new pair once they changed and are whole again; None meanwhile (a half-renewed
    pair is logged and the current one kept)."""
    if not files.changed():
        return None
    try:
        pair = files.load()
    except TlsFileError as e:  # mid-renewal: keep serving the current pair
        log.warning("renewed certificate not usable yet; keeping the current one", error=str(e))
        return None
    log.info("certificate reloaded", path=str(files.directory))
    return pair


def _self_signed(client_ca_file: str | None) -> KeyPair:
    """The pair served without ``--cert-path``; no client could verify it, so no client CA."""
    if client_ca_file:
        raise TlsFileError("--grpc-client-ca-file needs --cert-path (a certificate clients can verify)")
    key, cert = self_signed_pem()
    return KeyPair(key=key, cert=cert)


def _reloading_credentials(files: CertificateFiles, require_client_auth: bool) -> grpc.ServerCredentials:
    """Credentials whose key pair (and CA) follow the files; gRPC asks before each handshake."""
    lock = threading.Lock()  # gRPC may call the fetcher from several threads

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        with lock:
            pair = _renewed(files)
        return _server_config(pair) if pair is not None else None

    return grpc.dynamic_ssl_server_credentials(
        _server_config(files.load()), fetch, require_client_authentication=require_client_auth
    )


def server_credentials(
    cert_path: str | None, *, client_ca_file: str | None = None, reload: bool = False
) -> grpc.ServerCredentials:
    """The ext_proc server's credentials: ``--cert-path`` (as the reference), else self-signed.

    ``client_ca_file`` requires a client certificate signed by it; ``reload`` follows renewals.
    """
    if not cert_path:
        pair = _self_signed(client_ca_file)
        return grpc.ssl_server_credentials([(pair.key, pair.cert)])
    files = CertificateFiles(cert_path, client_ca_file, interval=RELOAD_INTERVAL)
    if reload:
        return _reloading_credentials(files, require_client_auth=client_ca_file is not None)
    pair = files.load()
    return grpc.ssl_server_credentials(
        [(pair.key, pair.cert)], root_certificates=pair.ca, require_client_auth=pair.ca is not None
    )


def server_ssl_context(
    cert_path: str | None, *, client_ca_file: str | None = None, reload: bool = False
) -> ssl.SSLContext:
    """``server_credentials`` for epp's own gRPC server (``epp.server.h2grpc``): the same files and
    checks; with ``reload`` each handshake after a renewal gets a context with the new files."""
    if not cert_path:
        return _ssl_context(_self_signed(client_ca_file))
    files = CertificateFiles(cert_path, client_ca_file, interval=RELOAD_INTERVAL)
    context = _ssl_context(files.load())
    if reload:
        current = [context]

        def follow(sslobj: ssl.SSLObject, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
            pair = _renewed(files)  # handshakes run on the event loop's thread: no lock
            if pair is not None:
                current[0] = _ssl_context(pair)
            if current[0] is not context:
                sslobj.context = current[0]

        context.sni_callback = follow
    return context


def _ssl_context(pair: KeyPair) -> ssl.SSLContext:
    """A TLS 1.2+ server context for ``pair`` (a client certificate signed by ``pair.ca`` required
    when there is one) with the ``--tls-cipher-suites`` TLS 1.2 suites; ALPN offers h2."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, pair)
    if pair.ca is not None:
        context.load_verify_locations(cadata=pair.ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    ciphers = os.environ.get("GRPC_SSL_CIPHER_SUITES")  # --tls-cipher-suites, as gRPC reads it
    if ciphers:
        context.set_ciphers(ciphers)
    context.set_alpn_protocols(["h2"])
    return context


def _load_chain(context: ssl.SSLContext, pair: KeyPair) -> None:
    """``load_cert_chain`` of the bytes in ``pair``: the ssl module reads key pairs from paths only,
    so on Linux they go to two anonymous in-memory files (``memfd_create``), read through
    ``/proc/self/fd``: nothing is written to any file system, and the bytes loaded are the ones
    checked (no race with a renewal of the mounted files). Elsewhere (no memfd: development hosts
    only) a private temporary directory, removed at once."""
    if not hasattr(os, "memfd_create"):
        _load_chain_via_tmp(context, pair)
        return
    fds: list[int] = []
    try:
        for data in (pair.cert, pair.key):
            fd = os.memfd_create("epp-tls", os.MFD_CLOEXEC)
            fds.append(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)


def _load_chain_via_tmp(context: ssl.SSLContext, pair: KeyPair) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="epp-tls-") as tmp:
        cert, key = Path(tmp) / CERT_FILE, Path(tmp) / KEY_FILE
        key.touch(0o600)
        key.write_bytes(pair.key)
        cert.write_bytes(pair.cert)
        context.load_cert_chain(cert, key)


def replica_server_credentials(cert_path: str, *, reload: bool = False) -> grpc.ServerCredentials:
    """mTLS for the replication port: a client certificate signed by ``cert_path/ca.crt`` is required."""
    files = CertificateFiles(cert_path, Path(cert_path) / CA_FILE, interval=RELOAD_INTERVAL)
    if reload:
        return _reloading_credentials(files, require_client_auth=True)
    pair = files.load()
    return grpc.ssl_server_credentials(
        [(pair.key, pair.cert)], root_certificates=pair.ca, require_client_auth=True
    )


def replica_channel_credentials(cert_path: str) -> grpc.ChannelCredentials:
    """A standby's credentials towards the leader (read on every connection: renewals apply)."""
    pair = CertificateFiles(cert_path, Path(cert_path) / CA_FILE).load()
    return grpc.ssl_channel_credentials(
        root_certificates=pair.ca, private_key=pair.key, certificate_chain=pair.cert
    )


def peer_names(auth_context: dict[str, list[bytes]]) -> set[str]:
    """The DNS names (and common name) of a TLS peer's verified certificate."""
    names = auth_context.get("x509_subject_alternative_name", []) + auth_context.get("x509_common_name", [])
    return {n.decode(errors="replace") for n in names}


# ------------------------------------------------------------------- issuing (epp certs)


def _new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, *, days: int
) -> x509.CertificateBuilder:
    """A certificate for ``key`` from ``subject`` by ``issuer``, valid from 5 minutes ago for ``days``."""
    from cryptography import x509

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))


@dataclass(frozen=True, slots=True)
class Authority:
    """A CA: its key and certificate (PEM)."""

    key: bytes
    cert: bytes

    @classmethod
    def create(cls, common_name: str = "epp-ca", days: int = 3650) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes

        key = _new_key()
        name = _name(common_name)
        cert = (
            _builder(name, name, key, days=days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(_key_pem(key), _cert_pem(cert))

    def issue(
        self,
        common_name: str,
        *,
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
        server: bool = True,
        client: bool = False,
        days: int = 365,
    ) -> KeyPair:
        """A key pair signed by this CA, for TLS servers and/or clients; ``ca`` is this CA."""
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import ExtendedKeyUsageOID

        ca_key = serialization.load_pem_private_key(self.key, password=None)
        ca_cert = x509.load_pem_x509_certificate(self.cert)
        key = _new_key()
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        builder = (
            _builder(_name(common_name), ca_cert.subject, key, days=days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                critical=False,
            )
        )
        alt: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
        alt += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        return KeyPair(_key_pem(key), _cert_pem(cert), self.cert)
