"""The harness CA issues certificates that name what clients use and chain to it."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from metaroce_harness.pki import CertificateAuthority, write_service_account_keys


def test_server_certificate_names_every_address_and_chains_to_the_ca(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    pair = ca.issue(
        "apiserver",
        "kube-apiserver",
        dns_names=("kubernetes",),
        ip_addresses=("127.0.0.1", "10.0.2.2"),
        server=True,
    )
    cert = x509.load_pem_x509_certificate(pair.cert_pem())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["kubernetes"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.0.2.2"),
    ]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    ca_cert = x509.load_pem_x509_certificate(ca.pair.cert_pem())
    cert.verify_directly_issued_by(ca_cert)


def test_client_certificate_carries_the_group_as_organization(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    pair = ca.issue("admin", "admin", organization="system:masters", client=True)
    cert = x509.load_pem_x509_certificate(pair.cert_pem())
    assert "O=system:masters" in cert.subject.rfc4514_string()
    assert (pair.key.stat().st_mode & 0o077) == 0, "private keys must not be group/world readable"


def test_service_account_keys_are_a_pem_pair(tmp_path: Path) -> None:
    pair = write_service_account_keys(tmp_path)
    assert pair.key_pem().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert pair.cert_pem().startswith(b"-----BEGIN PUBLIC KEY-----")
