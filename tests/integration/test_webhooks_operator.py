"""Every operator replica serves the admission webhooks; only the leader writes certificates.

Two real operator processes with the chart's arguments (`chart_arguments`, free ports) run
in the harness's pod network behind the chart's webhook Service (one EndpointSlice per
replica, as the endpoints controller would make for two pods), with the chart-rendered
webhook configurations. The real apiserver calls them over TLS. Shown here:
- both replicas answer admission (each one's decision counter grows);
- only the leader creates the certificate Secret and writes the caBundles (a caBundle
  removed by hand is restored by the leader, and only the leader's log says so);
- taking the leader away (its endpoint removed, then the process killed hard) leaves
  admission working without a failed request, and the new leader keeps the certificate.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_webhooks_env import WebhookEnv, apply_crds, pod_manifest, wait_for

from metaroce_harness.cluster import LocalCluster, free_port
from metaroce_operator.cli import chart_arguments

sys.path.insert(0, str(Path(__file__).parent / "operator"))
from operator_env import LoadGenerator, OperatorProcess

AGENT_IMAGE = "example.com/metaroce-agent:v0.1.0"
DECISIONS = "metaroce_webhook_decisions_total"


class TwoReplicas:
    def __init__(self, cluster: LocalCluster, tmp: Path) -> None:
        self.env = WebhookEnv(cluster)
        self.cluster = cluster
        self.tmp = tmp
        self.fullname = f"{self.env.release}-metaroce"
        self.ops: dict[str, OperatorProcess] = {}
        self.ports: dict[str, int] = {}
        self.loadgen: LoadGenerator | None = None

    def install(self) -> None:
        e, kubectl = self.env, self.cluster.kubectl
        apply_crds(self.cluster)
        kubectl("create", "namespace", e.namespace)
        kubectl("label", "namespace", e.namespace, "pod-security.kubernetes.io/enforce=privileged")
        kubectl("apply", "-f", "-", input=e.rendered_configurations())
        for identity in ("op-a", "op-b"):
            self.ports[identity] = free_port()
        e.port = self.ports["op-b"]  # where WebhookEnv.served_serial() looks
        kubectl(
            "apply",
            "-f",
            "-",
            input=yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": e.service, "namespace": e.namespace},
                    "spec": {"ports": [{"name": "https", "port": 443, "targetPort": 8443}]},
                }
            ),
        )
        for identity in self.ports:
            self.add_endpoint(identity)

    def add_endpoint(self, identity: str) -> None:
        podnet = self.cluster.pod_network
        assert podnet is not None
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{self.env.service}-{identity}",
                "namespace": self.env.namespace,
                "labels": {"kubernetes.io/service-name": self.env.service},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [podnet.pod_ip], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": self.ports[identity], "protocol": "TCP"}],
        }
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(slice_))

    def remove_endpoint(self, identity: str) -> None:
        self.cluster.kubectl(
            "delete", "endpointslice", f"{self.env.service}-{identity}", "-n", self.env.namespace
        )

    def start(self, identity: str) -> OperatorProcess:
        podnet = self.cluster.pod_network
        assert podnet is not None
        args = [
            a
            for a in chart_arguments(
                self.env.namespace,
                AGENT_IMAGE,
                fullname=self.fullname,
                webhook_port=self.ports[identity],
            )
            if not a.startswith(("--metrics-port", "--health-port"))
        ]
        args += [
            f"--metrics-port={free_port()}",
            f"--health-port={free_port()}",
            "--webhook-cert-check-interval=2s",
        ]
        op = OperatorProcess(
            args,
            kubeconfig=self.cluster.pod_network_kubeconfig(),
            log_path=self.tmp / f"{identity}.log",
            identity=identity,
            netns=podnet.netns,
            host=podnet.pod_ip,
        ).start()
        self.ops[identity] = op
        return op

    def lease_holder(self) -> str:
        out = self.cluster.kubectl(
            "get", "lease", "metaroce-operator", "-n", self.env.namespace, "-o", "json", check=False
        )
        if out.returncode != 0:
            return ""
        return str((json.loads(out.stdout).get("spec") or {}).get("holderIdentity") or "")

    def ca_bundles(self) -> list[str]:
        out = []
        for kind, name in (
            ("mutatingwebhookconfiguration", self.env.mutating),
            ("validatingwebhookconfiguration", self.env.validating),
        ):
            obj = json.loads(self.cluster.kubectl("get", kind, name, "-o", "json").stdout)
            out += [w["clientConfig"].get("caBundle", "") for w in obj["webhooks"]]
        return out

    def secret(self) -> dict[str, Any] | None:
        out = self.cluster.kubectl(
            "get", "secret", self.env.secret, "-n", self.env.namespace, "-o", "json", check=False
        )
        return json.loads(out.stdout) if out.returncode == 0 else None

    def decisions(self, identity: str) -> float:
        return self.ops[identity].metric(DECISIONS, endpoint="/mutate-pod", decision="allowed")

    def teardown(self) -> None:
        if self.loadgen is not None:
            self.loadgen.stop()
        kubectl = self.cluster.kubectl
        for name in self.env.networks:  # with the operators up, to honour finalizers
            kubectl("delete", "metarocenetwork", name, "--wait=true", "--timeout=30s", check=False)
        for op in self.ops.values():
            op.stop()
        self.env.networks = []
        self.env.teardown()


@pytest.fixture(scope="module")
def duo(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoReplicas]:
    d = TwoReplicas(cluster, tmp_path_factory.mktemp("webhook-operators"))
    try:
        d.install()
        yield d
    finally:
        d.teardown()


def create_pods(duo: TwoReplicas, namespace: str, count: int, failures: list[str]) -> int:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(duo.env.api)
    ok = 0
    for i in range(count):
        try:
            got = core.create_namespaced_pod(
                namespace, pod_manifest(f"p-{i}", duo.env.networks[0]), dry_run="All"
            )
            assert got.metadata.annotations["metaroce.io/injected"]
            ok += 1
        except ApiException as exc:
            failures.append(str(exc.body)[:300])
    return ok


def test_every_replica_serves_and_only_the_leader_writes_certificates(
    duo: TwoReplicas, namespace: str
) -> None:
    e = duo.env
    a = duo.start("op-a")
    wait_for("op-a to lead", lambda: duo.lease_holder() == "op-a", timeout=60)
    b = duo.start("op-b")
    # The leader made the Secret and published its CA; both replicas become ready on it.
    secret = wait_for("the certificate Secret", duo.secret, timeout=60)
    wait_for("the caBundles", lambda: all(duo.ca_bundles()), timeout=60)
    ca = base64.b64decode(secret["data"]["ca.crt"]).decode()
    assert all(base64.b64decode(v).decode() == ca for v in duo.ca_bundles())
    for op in (a, b):
        wait_for(f"{op.identity} ready", lambda op=op: op.probe("/readyz") == 200, timeout=60)
    assert duo.lease_holder() == "op-a"

    # A network with two ready nodes (a load generator stands in for their agents).
    net = f"be-{e.tag}"
    e.add_resource_nodes(net)
    duo.loadgen = LoadGenerator(duo.cluster.kubeconfig, e.namespace, net).start()
    e.create_network(net, healthy=0)

    def admitted() -> bool:
        return create_pods(duo, namespace, 1, []) == 1

    wait_for("the operator to report the network ready", admitted, timeout=120)

    # Both replicas answer: the apiserver picks an endpoint at random for every call.
    failures: list[str] = []
    before = {i: duo.decisions(i) for i in duo.ops}
    assert create_pods(duo, namespace, 40, failures) == 40, failures
    answered = {i: duo.decisions(i) - before[i] for i in duo.ops}
    assert all(n > 0 for n in answered.values()), answered

    # Only the leader writes: a caBundle removed by hand comes back, written by op-a.
    duo.cluster.kubectl(
        "patch",
        "mutatingwebhookconfiguration",
        e.mutating,
        "--type=json",
        "-p",
        '[{"op": "remove", "path": "/webhooks/0/clientConfig/caBundle"}]',
    )
    wait_for("the leader to restore the caBundle", lambda: all(duo.ca_bundles()), timeout=30)
    assert "caBundle written" in a.log()
    assert "caBundle written" not in b.log()
    assert "webhook certificates" not in b.log()
    serial = e.served_serial()

    # Take the leader away under load: its endpoint goes (as when its pod terminates), then
    # the process dies without releasing the lease. Admission never fails.
    stop = threading.Event()
    counts = {"ok": 0}

    def load() -> None:
        while not stop.is_set():
            counts["ok"] += create_pods(duo, namespace, 1, failures)
            time.sleep(0.05)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        time.sleep(1)
        duo.remove_endpoint("op-a")

        def drained() -> bool:  # the apiserver's EndpointSlice informer dropped op-a
            seen = duo.decisions("op-a")
            time.sleep(1.5)
            return duo.decisions("op-a") == seen

        wait_for("op-a to get no more admissions", drained, timeout=30)
        a.kill()
        wait_for("op-b to take the lease", lambda: duo.lease_holder() == "op-b", timeout=45)
        time.sleep(3)  # op-b's first certificate check as leader
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures
    assert counts["ok"] > 20, counts
    # The new leader found the certificate valid: same serving certificate, same CA.
    assert e.served_serial() == serial
    assert all(base64.b64decode(v).decode() == ca for v in duo.ca_bundles())
    after = duo.decisions("op-b")
    assert create_pods(duo, namespace, 5, failures) == 5, failures
    assert duo.decisions("op-b") == after + 5
