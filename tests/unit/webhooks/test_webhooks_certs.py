"""Certificates and their rotation plan (pure: no API)."""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

from cryptography import x509

from metaroce_operator.webhooks.certs import (
    CertBundle,
    issue_serving_cert,
    make_ca,
    plan_rotation,
    service_dns_names,
    split_pems,
    write_cert_files,
)

NAMES = service_dns_names("metaroce-webhook", "metaroce-system")
T0 = dt.datetime(2027, 1, 1, tzinfo=dt.UTC)


def signed_by(bundle: CertBundle, index: int) -> bool:
    ca = bundle.cas()[index]
    try:
        bundle.serving_cert().verify_directly_issued_by(ca)
    except Exception:
        return False
    return True


def sans(bundle: CertBundle) -> list[str]:
    ext = bundle.serving_cert().extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return ext.value.get_values_for_type(x509.DNSName)


def fresh() -> CertBundle:
    plan = plan_rotation(None, NAMES, now=T0)
    assert plan is not None and plan.reason == "created"
    return plan.bundle


def test_created_bundle_is_a_valid_chain_for_the_service() -> None:
    bundle = fresh()
    assert sans(bundle)[0] == "metaroce-webhook.metaroce-system.svc"
    assert set(NAMES) == set(sans(bundle))
    assert signed_by(bundle, 0)
    cert = bundle.serving_cert()
    assert cert.not_valid_after_utc - T0 > dt.timedelta(days=364)
    assert bundle.cas()[0].not_valid_after_utc - T0 > dt.timedelta(days=3649)


def test_a_good_bundle_needs_nothing() -> None:
    assert plan_rotation(fresh(), NAMES, now=T0 + dt.timedelta(days=100)) is None


def test_expiring_serving_cert_is_reissued_by_the_same_ca() -> None:
    old = fresh()
    plan = plan_rotation(old, NAMES, now=T0 + dt.timedelta(days=340))
    assert plan is not None and "expiring" in plan.reason
    assert plan.bundle.ca_bundle == old.ca_bundle, "the trusted CA must not change"
    assert plan.bundle.cert != old.cert and signed_by(plan.bundle, 0)


def test_names_change_reissues() -> None:
    plan = plan_rotation(fresh(), service_dns_names("other", "ns"), now=T0)
    assert plan is not None and "names changed" in plan.reason
    assert "other.ns.svc" in sans(plan.bundle)


def test_ca_rotation_publishes_the_new_ca_before_using_it() -> None:
    old = fresh()
    plan = plan_rotation(old, NAMES, now=T0, force_ca=True)
    assert plan is not None and "new CA added" in plan.reason
    step1 = plan.bundle
    assert len(step1.cas()) == 2
    assert step1.cert == old.cert, "the serving cert stays on the old CA for now"
    assert signed_by(step1, 1) and not signed_by(step1, 0)
    assert step1.ca_key != old.ca_key
    # The next serving-cert rotation signs with the new CA; both stay trusted.
    plan = plan_rotation(step1, NAMES, now=T0, force=True)
    assert plan is not None
    step2 = plan.bundle
    assert step2.ca_bundle == step1.ca_bundle
    assert signed_by(step2, 0)


def test_ca_near_its_end_is_renewed_and_expired_ca_dropped() -> None:
    old = fresh()
    late = T0 + dt.timedelta(days=3650 - 700)
    plan = plan_rotation(old, NAMES, now=late)
    assert plan is not None and "new CA added" in plan.reason
    assert len(plan.bundle.cas()) == 2
    after = T0 + dt.timedelta(days=3651)
    plan2 = plan_rotation(plan.bundle, NAMES, now=after)
    assert plan2 is not None
    assert "expired CA dropped" in plan2.reason
    assert len(plan2.bundle.cas()) == 1 and signed_by(plan2.bundle, 0)


def test_secret_owned_by_someone_else_is_left_alone() -> None:
    bundle = fresh()
    external = CertBundle(bundle.cert, bundle.key, bundle.ca_bundle, None)
    assert plan_rotation(external, NAMES, now=T0, force=True) is None


def test_unreadable_secret_starts_over() -> None:
    broken = CertBundle(b"junk", b"junk", b"junk", b"junk")
    plan = plan_rotation(broken, NAMES, now=T0)
    assert plan is not None and signed_by(plan.bundle, 0)


def test_secret_data_round_trip() -> None:
    bundle = fresh()
    assert CertBundle.from_secret_data(bundle.secret_data()) == bundle
    assert CertBundle.from_secret_data({"tls.crt": "eA=="}) is None


def test_serving_cert_never_outlives_its_ca() -> None:
    ca, key = make_ca(days=10, now=T0)
    cert, _ = issue_serving_cert(ca, key, ["a.b.svc"], days=365, now=T0)
    got = x509.load_pem_x509_certificate(cert)
    assert got.not_valid_after_utc <= x509.load_pem_x509_certificate(ca).not_valid_after_utc


def test_files_work_with_python_ssl(tmp_path: Path) -> None:
    bundle = fresh()
    write_cert_files(bundle, tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client = ssl.create_default_context(cadata=bundle.ca_bundle.decode())
    assert client.cert_store_stats()["x509_ca"] == 1
    assert len(split_pems(bundle.ca_bundle)) == 1
