"""Webhook certificates, made with `cryptography`, kept in one Secret shared by the replicas.

The Secret (type kubernetes.io/tls, the same keys cert-manager writes) holds:
- `tls.crt` / `tls.key`: the serving certificate of `<service>.<namespace>.svc`;
- `ca.crt`: the CA bundle the webhook configurations trust (newest CA first; during a
  CA rotation it holds the old and the new CA);
- `ca.key`: the key of the newest CA (absent when cert-manager owns the Secret).

Rotation without a failed admission (`plan_rotation`, pure):
- the serving certificate (1 year) is re-issued when within `renew_before` (30 days) of
  its end, or when its names are wrong; the CA does not change, so every replica can
  switch to the new certificate whenever it reloads it;
- the CA (10 years) is renewed when within `ca_renew_before` (2 years) of its end: the new
  CA is *added* to `ca.crt` first, while the serving certificate stays signed by the old
  one; the serving certificate is signed by the new CA only at a later rotation, when the
  bundle with the new CA has long been published by the leader (`patch_ca_bundles`).
  An expired CA drops out of the bundle.

`ensure_secret` (leader) applies the plan to the Secret (create if missing, replace with
the resourceVersion it read, so two replicas cannot both rotate); `patch_ca_bundles`
(leader) writes `ca.crt` into the webhook configurations; replicas only read the Secret.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from metaroce_api.failpoints import failpoint
from metaroce_operator.kube import JSON_PATCH, KINDS, ApiError, Kube

log = logging.getLogger("metaroce.webhooks.certs")

CERT_DAYS = 365
CA_DAYS = 3650
RENEW_BEFORE = dt.timedelta(days=30)
CA_RENEW_BEFORE = dt.timedelta(days=730)
SECRET_TYPE = "kubernetes.io/tls"
KEYS = ("tls.crt", "tls.key", "ca.crt", "ca.key")
SECRET = KINDS[("v1", "Secret")]
MUTATING_CONFIG = KINDS[("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration")]
VALIDATING_CONFIG = KINDS[("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration")]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def service_dns_names(service: str, namespace: str) -> list[str]:
    """The names the apiserver may use for a webhook Service (it uses `<svc>.<ns>.svc`)."""
    return [
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        f"{service}.{namespace}",
        service,
    ]


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(
    common_name: str = "metaroce-webhook-ca",
    *,
    days: int = CA_DAYS,
    now: dt.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A self-signed CA: (cert PEM, key PEM)."""
    now = now or utcnow()
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert), _key_pem(key)


def issue_serving_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    dns_names: Sequence[str],
    *,
    ip_addresses: Sequence[str] = (),
    days: int = CERT_DAYS,
    now: dt.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A serving certificate for `dns_names` signed by the CA: (cert PEM, key PEM).

    It never outlives the CA that signs it."""
    if not dns_names:
        raise ValueError("a serving certificate needs at least one DNS name")
    now = now or utcnow()
    ca_cert = x509.load_pem_x509_certificate(first_pem(ca_cert_pem))
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("ca.key is not an EC private key: delete the Secret to start over")
    key = _key()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _pem(cert), _key_pem(key)


def split_pems(bundle: bytes) -> list[bytes]:
    """The PEM certificates in a bundle, in order."""
    marker = b"-----END CERTIFICATE-----"
    out = []
    for part in bundle.split(marker):
        start = part.find(b"-----BEGIN CERTIFICATE-----")
        if start != -1:
            out.append(part[start:] + marker + b"\n")
    return out


def first_pem(bundle: bytes) -> bytes:
    pems = split_pems(bundle)
    if not pems:
        raise ValueError("no PEM certificate found")
    return pems[0]


# --- what the Secret holds --------------------------------------------------------------------


@dataclass(frozen=True)
class CertBundle:
    cert: bytes
    key: bytes
    ca_bundle: bytes
    """`ca.crt`: every CA the webhook configurations should trust, newest first."""
    ca_key: bytes | None = None
    """Key of the newest CA (None when another tool, e.g. cert-manager, owns the CA)."""

    def secret_data(self) -> dict[str, str]:
        data = {"tls.crt": self.cert, "tls.key": self.key, "ca.crt": self.ca_bundle}
        if self.ca_key is not None:
            data["ca.key"] = self.ca_key
        return {k: base64.b64encode(v).decode() for k, v in data.items()}

    @classmethod
    def from_secret_data(cls, data: dict[str, str] | None) -> CertBundle | None:
        data = data or {}
        if not all(k in data for k in ("tls.crt", "tls.key", "ca.crt")):
            return None
        raw = {k: base64.b64decode(v) for k, v in data.items() if k in KEYS}
        return cls(raw["tls.crt"], raw["tls.key"], raw["ca.crt"], raw.get("ca.key"))

    def serving_cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(first_pem(self.cert))

    def cas(self) -> list[x509.Certificate]:
        return [x509.load_pem_x509_certificate(p) for p in split_pems(self.ca_bundle)]


@dataclass(frozen=True)
class RotationPlan:
    bundle: CertBundle
    reason: str


def _dns_names(cert: x509.Certificate) -> set[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return set()
    return set(ext.value.get_values_for_type(x509.DNSName))


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:  # ValueError, TypeError, InvalidSignature
        return False
    return True


def plan_rotation(
    current: CertBundle | None,
    dns_names: Sequence[str],
    *,
    now: dt.datetime | None = None,
    cert_days: int = CERT_DAYS,
    ca_days: int = CA_DAYS,
    renew_before: dt.timedelta = RENEW_BEFORE,
    ca_renew_before: dt.timedelta = CA_RENEW_BEFORE,
    force: bool = False,
    force_ca: bool = False,
) -> RotationPlan | None:
    """The bundle the Secret should hold next, or None when it is fine as it is.

    `force` re-issues the serving certificate now; `force_ca` starts a CA rotation now
    (new CA added to the bundle, serving certificate untouched)."""
    now = now or utcnow()
    fresh = None
    if current is not None:
        try:
            cas = current.cas()
            serving = current.serving_cert()
        except ValueError as exc:
            log.warning("webhook certificate Secret is unreadable (%s): starting over", exc)
            fresh = "unreadable, made anew"
        else:
            if not cas:
                fresh = "no CA in ca.crt, made anew"
    if current is None or fresh:
        ca_cert, ca_key = make_ca(days=ca_days, now=now)
        cert, key = issue_serving_cert(ca_cert, ca_key, dns_names, days=cert_days, now=now)
        return RotationPlan(CertBundle(cert, key, ca_cert, ca_key), fresh or "created")
    if current.ca_key is None:
        return None  # someone else (cert-manager) owns this Secret
    reasons: list[str] = []
    newest = cas[0]
    live = [c for c in cas if c.not_valid_after_utc > now]
    reissue = force
    if newest.not_valid_after_utc <= now:
        ca_pem, ca_key = make_ca(days=ca_days, now=now)
        signer_pem, signer_key = ca_pem, ca_key
        bundle_pems = [ca_pem]
        reasons.append("CA expired, new CA")
        reissue = True
    else:
        ca_pem, ca_key = first_pem(current.ca_bundle), current.ca_key
        signer_pem, signer_key = ca_pem, ca_key
        bundle_pems = [_pem(c) for c in live]
        if len(live) < len(cas):
            reasons.append("expired CA dropped from the bundle")
        if force_ca or newest.not_valid_after_utc - now < ca_renew_before:
            # The new CA is published first; this pass still signs with the old one.
            ca_pem, ca_key = make_ca(days=ca_days, now=now)
            bundle_pems = [ca_pem, *bundle_pems]
            reasons.append("new CA added to the bundle")
    if not set(dns_names) <= _dns_names(serving):
        reissue = True
        reasons.append("serving certificate names changed")
    elif not any(_issued_by(serving, c) for c in live):
        reissue = True
        reasons.append("serving certificate not signed by a trusted CA")
    elif serving.not_valid_after_utc - now < renew_before:
        reissue = True
        reasons.append("serving certificate expiring")
    elif force:
        reasons.append("serving certificate rotation forced")
    cert, key = current.cert, current.key
    if reissue:
        cert, key = issue_serving_cert(signer_pem, signer_key, dns_names, days=cert_days, now=now)
    if not reasons:
        return None
    return RotationPlan(CertBundle(cert, key, b"".join(bundle_pems), ca_key), "; ".join(reasons))


# --- the Secret and the webhook configurations (through metaroce_operator.kube) ----------------


def _secret_body(name: str, namespace: str, bundle: CertBundle, version: str | None) -> Any:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/name": "metaroce", "app.kubernetes.io/component": "webhook"},
    }
    if version is not None:
        meta["resourceVersion"] = version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": SECRET_TYPE,
        "data": bundle.secret_data(),
    }


async def ensure_secret(
    kube: Kube,
    namespace: str,
    name: str,
    dns_names: Sequence[str],
    *,
    now: dt.datetime | None = None,
    force: bool = False,
    force_ca: bool = False,
    **lifetimes: Any,
) -> tuple[CertBundle, str | None]:
    """Make the Secret hold a valid bundle (create or rotate). Returns (bundle, what changed).

    `kube`: the operator's client (the leader's view, whose writes stop the moment the
    lease is lost). A write that loses a race with another replica (409) is not an
    error: the winner's bundle is read back and returned.
    """
    for _ in range(3):
        secret = await kube.get_or_none(SECRET, name, namespace)
        version = str((secret or {}).get("metadata", {}).get("resourceVersion") or "") or None
        current = CertBundle.from_secret_data((secret or {}).get("data"))
        plan = plan_rotation(
            current, dns_names, now=now, force=force, force_ca=force_ca, **lifetimes
        )
        if plan is None:
            assert current is not None
            return current, None
        body = _secret_body(name, namespace, plan.bundle, version)
        failpoint("certs.before_secret")
        try:
            if secret is None:
                await kube.create(body)
            else:
                await kube.replace(body)
        except ApiError as exc:
            if exc.status == 409:
                force = force_ca = False  # someone else just wrote it: take theirs
                continue
            raise
        failpoint("certs.after_secret")  # the caBundles do not trust a new CA yet
        log.info("webhook certificate Secret %s/%s: %s", namespace, name, plan.reason)
        return plan.bundle, plan.reason
    raise RuntimeError(f"could not settle the certificate Secret {namespace}/{name} (409 x3)")


async def patch_ca_bundles(
    kube: Kube,
    ca_bundle: bytes,
    *,
    mutating: Sequence[str] = (),
    validating: Sequence[str] = (),
) -> list[str]:
    """Write `ca_bundle` into every webhook of the named configurations (leader only).

    Configurations that do not exist are skipped (the chart may not have installed them
    yet); only webhooks whose caBundle differs are patched, with a JSON patch that tests
    each webhook's name first. Returns what was patched."""
    encoded = base64.b64encode(ca_bundle).decode()
    patched: list[str] = []
    for kind, names in ((MUTATING_CONFIG, mutating), (VALIDATING_CONFIG, validating)):
        for name in names:
            obj = await kube.get_or_none(kind, name)
            if obj is None:
                continue
            ops = []
            for i, hook in enumerate(obj.get("webhooks") or []):
                if ((hook.get("clientConfig") or {}).get("caBundle") or "") != encoded:
                    ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook["name"]})
                    ops.append(
                        {
                            "op": "add",
                            "path": f"/webhooks/{i}/clientConfig/caBundle",
                            "value": encoded,
                        }
                    )
            if ops:
                await kube.patch(kind, name, ops, content_type=JSON_PATCH)
                failpoint("certs.after_ca_bundle")  # one configuration patched, maybe not all
                patched.append(f"{kind.kind}/{name}")
    if patched:
        log.info("caBundle written to %s", ", ".join(patched))
    return patched


def write_cert_files(bundle: CertBundle, directory: Path) -> None:
    """Write tls.crt / tls.key / ca.crt atomically (what a Secret volume would show)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in (
        ("tls.key", bundle.key),
        ("tls.crt", bundle.cert),
        ("ca.crt", bundle.ca_bundle),
    ):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, directory / name)
