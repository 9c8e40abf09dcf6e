"""TLS material for ``--secure-serving``: the files in ``--cert-path`` or a fresh self-signed pair."""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc


def self_signed_pem(common_name: str = "epp") -> tuple[bytes, bytes]:
    """A fresh EC key and self-signed certificate, as PEM ``(key, cert)``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_credentials(cert_path: str | None) -> grpc.ServerCredentials:
    """``tls.key``/``tls.crt`` from ``cert_path`` (as the reference), else a self-signed certificate."""
    if cert_path:
        base = Path(cert_path)
        key, cert = (base / "tls.key").read_bytes(), (base / "tls.crt").read_bytes()
    else:
        key, cert = self_signed_pem()
    return grpc.ssl_server_credentials([(key, cert)])
