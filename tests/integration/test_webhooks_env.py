"""Shared set-up of the webhook integration tests and the webhook benchmark (no tests here:
the `test_webhooks_` prefix only keeps it with the files it serves).

`WebhookEnv` installs what a user installs, on the harness's real control plane:
- the CRDs (`kubectl apply --server-side -f crds/`);
- the webhook configurations rendered from the chart (`helm template --show-only
  templates/webhook-configurations.yaml`) for a release in a namespace of its own;
- the certificate Secret and caBundles, written as the operator's leader does
  (`certs.ensure_secret` + `certs.patch_ca_bundles`);
- one webhook replica (`python -m metaroce_operator.webhooks --cert-secret ...`) in the
  pod network, behind the chart's Service name (a selector-less Service + EndpointSlice).

`mode` is the chart's `admission.mode`: `webhook` (the pod webhook mutates), or `policy`
(no pod webhook; the chart's ValidatingAdmissionPolicy, and for each network created the
MutatingAdmissionPolicy and binding that the operator renders, `render_pod_policy`,
applied as the operator applies them: server-side, its field manager, owned by the
network). The network validation webhook is there in both modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

from cryptography import x509

from metaroce_api import constants as c
from metaroce_harness.cluster import Component, FakeNode, LocalCluster, free_port
from metaroce_harness.polling import wait_for as wait_for  # re-exported for the tests
from metaroce_operator.kube import Kube, load_credentials
from metaroce_operator.render.podpolicy import policy_name, render_pod_policy
from metaroce_operator.settings import RenderSettings
from metaroce_operator.webhooks import certs

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "metaroce"
CRDS = REPO / "crds"


def apply_crds(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    for name in (c.NETWORK_CRD_NAME, c.NODESTATE_CRD_NAME):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


class WebhookEnv:
    def __init__(
        self, cluster: LocalCluster, tag: str | None = None, mode: str = "webhook"
    ) -> None:
        assert cluster.pod_network is not None and cluster.workdir is not None
        assert mode in ("webhook", "policy"), mode
        self.mode = mode
        self.cluster = cluster
        self.tag = tag or secrets.token_hex(3)
        self.namespace = f"mrwh-{self.tag}"
        self.release = f"w{self.tag}"
        fullname = f"{self.release}-metaroce"
        self.service = f"{fullname}-webhook"
        self.secret = f"{fullname}-webhook-tls"
        self.mutating = f"{fullname}-pods"
        self.validating = f"{fullname}-networks"
        self.pod_policy = f"{fullname}-pods"
        """The chart's ValidatingAdmissionPolicy (and binding) of the policy mode."""
        self.port = free_port()
        self.metrics_port = free_port()
        self.kubeconfig = cluster.pod_network_kubeconfig()
        self.api = cluster.api_client()
        self.replica: Component | None = None
        self.nodes: list[str] = []
        self.networks: list[str] = []
        self.bundle: certs.CertBundle | None = None

    # -- install ------------------------------------------------------------------------

    def rendered(self, template: str, *extra: str, mode: str | None = None) -> str:
        out = self.cluster.helm(
            "template",
            self.release,
            str(CHART),
            "--namespace",
            self.namespace,
            "--set",
            f"namespace.name={self.namespace}",  # the operator's namespace (Service, Secret)
            "--set",
            f"admission.mode={mode or self.mode}",
            "--kube-version",
            "v1.37.2",
            "--show-only",
            f"templates/{template}",
            *extra,
        ).stdout
        return out

    def rendered_configurations(self, *extra: str) -> str:
        return self.rendered("webhook-configurations.yaml", *extra)

    def rendered_pod_policies(self) -> str:
        """The chart's ValidatingAdmissionPolicy + binding (of the policy mode)."""
        return self.rendered("pod-policies.yaml", mode="policy")

    def install(self) -> None:
        apply_crds(self.cluster)
        self.cluster.kubectl("create", "namespace", self.namespace)
        self.cluster.kubectl("apply", "-f", "-", input=self.rendered_configurations())
        if self.mode == "policy":
            self.cluster.kubectl("apply", "-f", "-", input=self.rendered_pod_policies())
        self.lead_certificates()
        self.cluster.expose_in_pod_network(
            self.namespace, self.service, port=443, target_port=self.port
        )
        self.start_replica()

    def lead_certificates(self, *, force: bool = False, force_ca: bool = False) -> str | None:
        """What the operator's leader does: make/rotate the Secret, publish the CA."""

        async def lead() -> tuple[certs.CertBundle, str | None]:
            kube = Kube(load_credentials(str(self.cluster.kubeconfig)), user_agent="webhook-tests")
            try:
                bundle, changed = await certs.ensure_secret(
                    kube,
                    self.namespace,
                    self.secret,
                    certs.service_dns_names(self.service, self.namespace),
                    force=force,
                    force_ca=force_ca,
                )
                await certs.patch_ca_bundles(
                    kube, bundle.ca_bundle, mutating=[self.mutating], validating=[self.validating]
                )
                return bundle, changed
            finally:
                await kube.close()

        self.bundle, changed = asyncio.run(lead())
        return changed

    def start_replica(self) -> None:
        assert self.cluster.pod_network is not None
        argv = [
            sys.executable,
            "-m",
            "metaroce_operator.webhooks",
            "--port",
            str(self.port),
            "--cert-secret",
            f"{self.namespace}/{self.secret}",
            "--kubeconfig",
            str(self.kubeconfig),
            "--service",
            self.service,
            "--service-namespace",
            self.namespace,
            "--metrics-port",
            str(self.metrics_port),
        ]
        self.replica = self.cluster.pod_network.popen(argv, log_name=f"webhook-{self.tag}")
        wait_for("the webhook replica to serve /healthz", self.healthy, timeout=60)

    def stop_replica(self) -> None:
        if self.replica is not None:
            self.replica.stop()
            self.replica = None

    def teardown(self) -> None:
        self.stop_replica()
        kubectl = self.cluster.kubectl
        kubectl("delete", "mutatingwebhookconfiguration", self.mutating, check=False)
        kubectl("delete", "validatingwebhookconfiguration", self.validating, check=False)
        if self.mode == "policy":
            kubectl("delete", "validatingadmissionpolicybinding", self.pod_policy, check=False)
            kubectl("delete", "validatingadmissionpolicy", self.pod_policy, check=False)
        for name in self.networks:
            kubectl("delete", "metarocenetwork", name, "--wait=false", check=False)
        for name in self.nodes:
            kubectl("delete", "node", name, "--wait=false", check=False)
        kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)

    # -- probes ---------------------------------------------------------------------------

    def _tls(self) -> ssl.SSLContext:
        assert self.bundle is not None
        ctx = ssl.create_default_context(cadata=self.bundle.ca_bundle.decode())
        ctx.check_hostname = False
        return ctx

    def healthy(self) -> bool:
        if self.replica is not None:
            self.replica.check_alive()
        assert self.cluster.pod_network is not None
        with contextlib.suppress(OSError):
            addr = (self.cluster.pod_network.pod_ip, self.port)
            with (
                socket.create_connection(addr, timeout=2) as raw,
                self._tls().wrap_socket(raw) as conn,
            ):
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                return conn.recv(64).startswith(b"HTTP/1.1 200")
        return False

    def metrics_text(self) -> str:
        """The replica's Prometheus metrics (it serves them in the pod network)."""
        import urllib.request

        assert self.cluster.pod_network is not None
        url = f"http://{self.cluster.pod_network.pod_ip}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    def served_serial(self) -> int | None:
        """Serial of the certificate the replica presents to a new connection."""
        assert self.cluster.pod_network is not None
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with contextlib.suppress(OSError):
            addr = (self.cluster.pod_network.pod_ip, self.port)
            with socket.create_connection(addr, timeout=2) as raw, ctx.wrap_socket(raw) as conn:
                der = conn.getpeercert(binary_form=True)
                return x509.load_der_x509_certificate(der).serial_number if der else None
        return None

    # -- objects ----------------------------------------------------------------------------

    def add_resource_nodes(self, network: str, count: int = 2, units: str = "4") -> list[str]:
        names = [f"wh-{self.tag}-{network[-6:]}-{i}" for i in range(count)]
        resource = f"metaroce.io/{network}"
        self.cluster.add_nodes(
            [
                FakeNode(n, labels={"webhook-test": self.tag}, capacity={resource: units})
                for n in names
            ]
        )
        self.nodes += names
        return names

    def create_network(self, name: str, healthy: int = 2, **spec: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": c.API_VERSION,
            "kind": c.NETWORK_KIND,
            "metadata": {"name": name},
            "spec": {
                # NICs nobody else selects: other tests' networks must not conflict.
                "nics": {"interfaceNames": [f"wh{self.tag}{len(self.networks)}"]},
                "nodeSelector": {"matchLabels": {"webhook-test": self.tag}},
                **spec,
            },
        }
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(body))
        self.networks.append(name)
        if healthy:
            self.set_healthy(name, healthy)
        if self.mode == "policy":
            self.apply_pod_policy(name)
        return body

    def pod_policy_documents(self, name: str) -> str:
        """The network's MutatingAdmissionPolicy + binding as the operator renders them."""
        from metaroce_api import validate_network

        live = json.loads(self.cluster.kubectl("get", c.NETWORK_PLURAL, name, "-o", "json").stdout)
        objects = render_pod_policy(validate_network(live), RenderSettings(admission_mode="policy"))
        return "\n---\n".join(json.dumps(o) for o in objects)

    def apply_pod_policy(self, name: str) -> list[dict[str, Any]]:
        """What the operator does in policy mode for network `name`: render its
        MutatingAdmissionPolicy + binding from the live object (uid: the owner reference)
        and apply them server-side under the operator's field manager."""
        from metaroce_api import validate_network

        live = json.loads(self.cluster.kubectl("get", c.NETWORK_PLURAL, name, "-o", "json").stdout)
        objects = render_pod_policy(validate_network(live), RenderSettings(admission_mode="policy"))
        for obj in objects:
            self.cluster.kubectl(
                "apply",
                "--server-side",
                "--force-conflicts",
                f"--field-manager={c.FIELD_MANAGER}",
                "-f",
                "-",
                input=json.dumps(obj),
            )
        return objects

    def pod_policy_objects(self, name: str) -> list[str]:
        """Which of the network's policy and binding exist."""
        found = []
        for kind in ("mutatingadmissionpolicy", "mutatingadmissionpolicybinding"):
            proc = self.cluster.kubectl("get", kind, policy_name(name), check=False)
            if proc.returncode == 0:
                found.append(kind)
        return found

    def set_healthy(self, name: str, healthy: int, desired: int = 2) -> None:
        status = {
            "status": {
                "nodes": {
                    "desired": desired,
                    "configured": healthy,
                    "healthy": healthy,
                    "failed": 0,
                }
            }
        }
        self.cluster.kubectl(
            "patch",
            "metarocenetwork",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )

    def wait_cached(self, name: str) -> None:
        """Until the replica's watch has the network, or in policy mode the apiserver
        runs its policy (a dry-run pod tells)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self.api)

        def admitted() -> bool:
            try:
                got = core.create_namespaced_pod(
                    "default", pod_manifest("probe", name), dry_run="All"
                )
            except ApiException:
                return False  # not cached yet ("does not exist"), or not synced (503)
            return bool(injected_networks(got.metadata.annotations or {}))

        wait_for(f"the admission of network {name}'s pods", admitted, timeout=30)
        if self.mode == "policy":
            self.wait_refusing()

    def wait_refusing(self) -> None:
        """Policy mode: until the chart's ValidatingAdmissionPolicy is in force (the
        apiserver loads policies asynchronously)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self.api)

        def refused() -> bool:
            try:
                core.create_namespaced_pod(
                    "default", pod_manifest("probe", "no-such-net-probe"), dry_run="All"
                )
            except ApiException as exc:
                return "does not exist" in str(exc.body)
            return False

        wait_for("the pod ValidatingAdmissionPolicy to refuse", refused, timeout=30)


def injected_networks(annotations: dict[str, str]) -> list[str]:
    """The networks a pod's admission recorded: the webhook's `metaroce.io/injected`, or
    the policies' `injected.metaroce.io/<network>`."""
    if c.INJECTED_ANNOTATION in annotations:
        return list(json.loads(annotations[c.INJECTED_ANNOTATION]).get("networks") or [])
    prefix = c.POLICY_INJECTED_PREFIX + "/"
    return [k[len(prefix) :] for k in annotations if k.startswith(prefix)]


def pod_manifest(
    name: str, networks: str | None, *, finalizers: list[str] | None = None, **meta: Any
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, **meta}
    if networks is not None:
        metadata.setdefault("annotations", {})[c.NETWORKS_ANNOTATION] = networks
    if finalizers:
        metadata["finalizers"] = finalizers
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/train:1"}]},
    }
