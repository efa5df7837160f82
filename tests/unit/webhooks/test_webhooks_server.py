"""The HTTPS server over loopback: AdmissionReview in and out, keep-alive, cert reload."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from webhook_testlib import apply_patch, network_obj, pod, view, views

from metaroce_operator.webhooks.certs import (
    CertBundle,
    issue_serving_cert,
    make_ca,
    write_cert_files,
)
from metaroce_operator.webhooks.server import (
    AdmissionHandler,
    ServerOptions,
    WebhookServer,
)

NETS = views(view("backend"), view("storage", nics={"drivers": ["mlx5_core"]}))


def make_bundle(ca: tuple[bytes, bytes] | None = None) -> CertBundle:
    ca_cert, ca_key = ca or make_ca()
    cert, key = issue_serving_cert(ca_cert, ca_key, ["localhost"], ip_addresses=["127.0.0.1"])
    return CertBundle(cert, key, ca_cert, ca_key)


class Harness:
    def __init__(
        self, tmp: Path, synced: bool = True, labels: dict[str, str] | None = None
    ) -> None:
        self.dir = tmp
        self.bundle = make_bundle()
        write_cert_files(self.bundle, tmp)
        self.synced = threading.Event()
        if synced:
            self.synced.set()
        self.handler = AdmissionHandler(
            lambda: NETS,
            self.synced,
            lambda ns: labels if labels is not None else {},
            lambda: {"n1": {}},
            sync_timeout=0.2,
        )
        self.server = WebhookServer(
            ServerOptions(cert_dir=tmp, address="127.0.0.1", port=0, reload_interval=0.1),
            self.handler,
        )
        self.server.start()

    def connect(self, ca: bytes | None = None) -> http.client.HTTPSConnection:
        ctx = ssl.create_default_context(cadata=(ca or self.bundle.ca_bundle).decode())
        return http.client.HTTPSConnection("127.0.0.1", self.server.port, context=ctx, timeout=5)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.server.stop()


def review(
    obj: dict[str, Any], *, operation: str = "CREATE", old: Any = None, ns: str = "jobs"
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "operation": operation,
            "namespace": ns,
            "object": obj,
            "oldObject": old,
        },
    }


def post(conn: http.client.HTTPSConnection, path: str, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    out: dict[str, Any] = json.loads(resp.read())
    assert out["kind"] == "AdmissionReview"
    return out["response"]  # type: ignore[no-any-return]


def post_raw(conn: http.client.HTTPSConnection, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """The HTTP status and body of one POST (for answers that are not AdmissionReviews)."""
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


def test_mutate_answers_a_jsonpatch_over_keepalive(harness: Harness) -> None:
    conn = harness.connect()
    for _ in range(3):  # one connection, several reviews
        resp = post(conn, "/mutate-pod", review(pod("backend")))
        assert resp["uid"] == "u-1" and resp["allowed"] is True
        assert resp["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(resp["patch"]))
        out = apply_patch(pod("backend"), ops)
        assert out["spec"]["containers"][0]["resources"]["limits"] == {"metaroce.io/backend": "1"}
    conn.close()


def test_refusal_carries_status_and_message(harness: Harness) -> None:
    resp = post(harness.connect(), "/mutate-pod", review(pod("nosuch")))
    assert resp["allowed"] is False
    assert resp["status"]["code"] == 403
    assert "network 'nosuch'" in resp["status"]["message"]


def test_validate_network_refuses_conflicts_and_skips_unchanged_specs(harness: Harness) -> None:
    conn = harness.connect()
    bad = network_obj("new", attachment={"resourceName": "metaroce.io/backend"})
    resp = post(conn, "/validate-network", review(bad))
    assert resp["allowed"] is False and resp["status"]["code"] == 422
    assert "spec.attachment.resourceName" in resp["status"]["message"]
    # An update that does not change the spec (e.g. a finalizer removed) always passes.
    resp = post(conn, "/validate-network", review(bad, operation="UPDATE", old=bad))
    assert resp["allowed"] is True
    good = network_obj("new", nics={"interfaceNames": ["eth7"]})
    assert post(conn, "/validate-network", review(good))["allowed"] is True


def test_update_operations_are_not_mutated(harness: Harness) -> None:
    resp = post(harness.connect(), "/mutate-pod", review(pod("nosuch"), operation="UPDATE"))
    assert resp == {"uid": "u-1", "allowed": True}


def test_health_and_unsynced_cache(tmp_path: Path) -> None:
    h = Harness(tmp_path, synced=False)
    try:
        conn = h.connect()
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 503 and resp.read() == b"networks not loaded"
        # Not an AdmissionReview that says allowed: false (the apiserver would honour that
        # whatever the failurePolicy) but an HTTP error, so that the policy decides.
        status, text = post_raw(conn, "/mutate-pod", review(pod("backend")))
        assert status == 503, text
        assert "has not loaded the MetaRoceNetworks yet" in text
        h.synced.set()
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b"ok"
    finally:
        h.server.stop()


def test_pod_security_refusal_uses_namespace_labels(tmp_path: Path) -> None:
    h = Harness(tmp_path, labels={"pod-security.kubernetes.io/enforce": "baseline"})
    try:
        answer = post(h.connect(), "/mutate-pod", review(pod("backend")))
        assert (
            answer["allowed"] is False
            and "Pod Security level 'baseline'" in answer["status"]["message"]
        )
    finally:
        h.server.stop()


def test_bad_requests(harness: Harness) -> None:
    conn = harness.connect()
    conn.request("POST", "/mutate-pod", b"not json", {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400
    resp.read()
    conn.request("POST", "/elsewhere", b"{}")
    resp = conn.getresponse()
    assert resp.status == 404
    resp.read()


def test_rotated_files_are_served_to_new_connections(harness: Harness) -> None:
    old_conn = harness.connect()
    assert post(old_conn, "/mutate-pod", review(pod("backend")))["allowed"]
    rotated = make_bundle()  # a different CA altogether, to tell them apart
    write_cert_files(rotated, harness.dir)
    deadline = time.monotonic() + 5
    while True:
        try:
            conn = harness.connect(rotated.ca_bundle)
            assert post(conn, "/mutate-pod", review(pod("backend")))["allowed"]
            break
        except ssl.SSLError:
            assert time.monotonic() < deadline, "the rotated certificate was not picked up"
            time.sleep(0.1)
    # The connection made before the rotation goes on working.
    assert post(old_conn, "/mutate-pod", review(pod("backend")))["allowed"]


def test_mismatched_files_keep_the_old_certificate(harness: Harness) -> None:
    other = make_bundle()
    (harness.dir / "tls.key").write_bytes(other.key)  # key replaced, cert not yet
    time.sleep(0.4)
    assert post(harness.connect(), "/mutate-pod", review(pod("backend")))["allowed"]


def test_internal_errors_are_http_errors_so_the_failure_policy_decides(tmp_path: Path) -> None:
    h = Harness(tmp_path)

    def broken(_: str) -> dict[str, str]:
        raise RuntimeError("boom")

    h.handler.namespace_labels = broken
    try:
        conn = h.connect()
        for path, obj in (("/mutate-pod", pod("backend")), ("/validate-network", {"x": 1})):
            if path == "/validate-network":
                h.handler.node_labels = lambda: broken("")
            status, text = post_raw(conn, path, review(obj))
            assert status == 500, text
            assert "RuntimeError: boom" in text
    finally:
        h.server.stop()


def test_app_readiness_needs_a_certificate_and_a_synced_cache(tmp_path: Path) -> None:
    """What the operator's /readyz reports for its webhook (the API is unreachable here, so
    the network watch keeps retrying and the test marks the cache synced itself)."""
    from metaroce_operator.kube import Credentials
    from metaroce_operator.webhooks.server import AppOptions, WebhookApp

    app = WebhookApp(
        AppOptions(cert_dir=tmp_path, address="127.0.0.1", port=0),
        Credentials(server="https://127.0.0.1:1"),
    )
    ok, why = app.ready()
    assert not ok and "no serving certificate" in why
    write_cert_files(make_bundle(), tmp_path)
    app.start()
    try:
        ok, why = app.ready()
        assert not ok and "not loaded the MetaRoceNetworks" in why
        app.watch.set_views(NETS)
        app.watch.synced.set()
        ok, why = app.ready()
        assert ok and why.startswith("webhook serving on port")
    finally:
        app.stop()
