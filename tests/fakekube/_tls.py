"""A throw-away CA and a server certificate for 127.0.0.1/localhost, for the fake's TLS mode."""

from __future__ import annotations

from dataclasses import dataclass

from epp.server.tls import Authority


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes: the CA certificate clients trust, and the server's key and certificate chain."""

    ca_pem: bytes
    server_key_pem: bytes
    server_cert_pem: bytes


def make_tls_material() -> TlsMaterial:
    """A fresh CA and a CA-signed server certificate valid for IP 127.0.0.1 and DNS ``localhost``.

    Both certificates carry the extensions strict X.509 verification (``VERIFY_X509_STRICT``,
    the default in newer Pythons) requires.
    """
    ca = Authority.create("fakekube-ca", days=1)
    server = ca.issue("fakekube", dns_names=("localhost",), ip_addresses=("127.0.0.1",), days=1)
    return TlsMaterial(ca_pem=ca.cert, server_key_pem=server.key, server_cert_pem=server.cert)
