"""The admission webhooks on a real control plane: the apiserver calls them over TLS
through the chart's Service, with the chart's configurations (matchConditions included)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_webhooks_env import WebhookEnv, pod_manifest, wait_for

from metaroce_harness.cluster import LocalCluster


@pytest.fixture(scope="module")
def env(cluster: LocalCluster) -> Iterator[WebhookEnv]:
    e = WebhookEnv(cluster)
    try:
        e.install()
        e.add_resource_nodes(f"be-{e.tag}")
        e.create_network(
            f"be-{e.tag}", healthy=2, qos={"data": {"dscp": 26}}, transport={"qpsPerConnection": 4}
        )
        e.create_network(f"cold-{e.tag}", healthy=0)
        e.wait_cached(f"be-{e.tag}")
        yield e
    finally:
        e.teardown()


@pytest.fixture
def running(env: WebhookEnv) -> WebhookEnv:
    """The env with its replica up (a test before may have stopped it)."""
    if env.replica is None:
        env.start_replica()
    return env


def create(cluster: LocalCluster, namespace: str, body: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl(
        "create", "-n", namespace, "-o", "json", "-f", "-", input=json.dumps(body), check=check
    )


def test_annotated_pod_is_mutated_and_lands_on_resource_nodes(
    cluster: LocalCluster, running: WebhookEnv, namespace: str
) -> None:
    net = f"be-{running.tag}"
    out = json.loads(create(cluster, namespace, pod_manifest("trainer", net)).stdout)
    main = out["spec"]["containers"][0]
    assert main["resources"]["limits"] == {f"metaroce.io/{net}": "1"}
    assert main["resources"]["requests"] == {f"metaroce.io/{net}": "1"}
    assert main["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env == {
        "NCCL_IB_TC": "104",
        "NCCL_IB_QPS_PER_CONNECTION": "4",
        "NCCL_IB_TIMEOUT": "20",
        "NCCL_IB_RETRY_CNT": "7",
    }
    injected = json.loads(out["metadata"]["annotations"]["metaroce.io/injected"])
    assert injected["networks"] == [net] and injected["env"] == env

    def node() -> str:
        got = cluster.kubectl("get", "pod", "trainer", "-n", namespace, "-o", "json").stdout
        return str(json.loads(got)["spec"].get("nodeName", ""))

    assert wait_for("the pod to be scheduled", node) in running.nodes


def test_user_values_survive_the_real_apiserver(
    cluster: LocalCluster, running: WebhookEnv, namespace: str
) -> None:
    body = pod_manifest("custom", f"be-{running.tag}")
    body["spec"]["containers"][0]["env"] = [{"name": "NCCL_IB_TC", "value": "96"}]
    out = json.loads(create(cluster, namespace, body).stdout)
    env = {e["name"]: e["value"] for e in out["spec"]["containers"][0]["env"]}
    assert env["NCCL_IB_TC"] == "96"
    assert env["NCCL_IB_QPS_PER_CONNECTION"] == "4"


@pytest.mark.parametrize(
    ("networks", "words"),
    [
        ("nosuch", ["network 'nosuch'", "does not exist", "(ready)"]),
        ("Bad_Name", ["is not a network name"]),
    ],
)
def test_refusals_reach_the_user(
    cluster: LocalCluster, running: WebhookEnv, namespace: str, networks: str, words: list[str]
) -> None:
    networks = networks.format(tag=running.tag)
    proc = create(cluster, namespace, pod_manifest("refused", networks), check=False)
    assert proc.returncode != 0
    assert 'admission webhook "pods.metaroce.io" denied the request' in proc.stderr
    for word in words:
        assert word.format(tag=running.tag) in proc.stderr
    if "nosuch" in networks:
        assert f"be-{running.tag}" in proc.stderr  # lists what exists


def test_a_network_without_a_healthy_node_still_admits_pods(
    cluster: LocalCluster, running: WebhookEnv, namespace: str
) -> None:
    """Node health is not admission's business (issue 16 #5): during a rollout no node is
    healthy, and the scheduler keeps the pod Pending until a node has the resource."""
    out = json.loads(create(cluster, namespace, pod_manifest("cold", f"cold-{running.tag}")).stdout)
    limits = out["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {f"metaroce.io/cold-{running.tag}": "1"}


def test_pod_security_baseline_namespace_is_refused_with_the_reason(
    cluster: LocalCluster, running: WebhookEnv, namespace: str
) -> None:
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline")
    proc = create(cluster, namespace, pod_manifest("pss", f"be-{running.tag}"), check=False)
    assert proc.returncode != 0
    assert "enforces the Pod Security level 'baseline'" in proc.stderr
    assert "IPC_LOCK" in proc.stderr


def test_network_validation_refuses_what_cel_cannot_see(running: WebhookEnv) -> None:
    cluster = running.cluster
    body = {
        "apiVersion": "metaroce.io/v1alpha1",
        "kind": "MetaRoceNetwork",
        "metadata": {"name": f"dup-{running.tag}"},
        "spec": {
            "nics": {"interfaceNames": ["dupnic0"]},
            "attachment": {"resourceName": f"metaroce.io/be-{running.tag}"},
        },
    }
    proc = cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)
    assert proc.returncode != 0
    assert 'admission webhook "networks.metaroce.io" denied the request' in proc.stderr
    assert "spec.attachment.resourceName" in proc.stderr and f"be-{running.tag}" in proc.stderr
    body["spec"] = {"nics": {"drivers": ["virtio_net"]}, "transport": {"mode": "rocev2"}}
    proc = cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)
    assert proc.returncode != 0 and "rocev2 needs hardware RoCE" in proc.stderr
    # The same NICs as be-<tag> on nodes both select: the replica reads the nodes' labels.
    body["spec"] = {
        "nics": {"interfaceNames": [f"wh{running.tag}*"]},
        "nodeSelector": {"matchExpressions": [{"key": "webhook-test", "operator": "Exists"}]},
    }
    proc = cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)
    assert proc.returncode != 0
    assert f"network 'be-{running.tag}' can select the same NICs on 2 node(s)" in proc.stderr
    assert running.nodes[0] in proc.stderr


def test_operator_stopped(cluster: LocalCluster, running: WebhookEnv, namespace: str) -> None:
    net = f"be-{running.tag}"
    held = create(cluster, namespace, pod_manifest("held", net, finalizers=["example.com/hold"]))
    assert "metaroce.io/injected" in held.stdout
    running.stop_replica()
    try:
        # Unannotated pods are never sent to the webhook: created, untouched.
        out = json.loads(create(cluster, namespace, pod_manifest("plain", None)).stdout)
        assert "metaroce.io/injected" not in (out["metadata"].get("annotations") or {})
        assert "env" not in out["spec"]["containers"][0]
        # Annotated pods fail closed, and the error names the webhook.
        proc = create(cluster, namespace, pod_manifest("blocked", net), check=False)
        assert proc.returncode != 0
        assert 'failed calling webhook "pods.metaroce.io"' in proc.stderr
        # Updates are not intercepted: a finalizer can be removed (e.g. by the Job controller).
        cluster.kubectl(
            "patch",
            "pod",
            "held",
            "-n",
            namespace,
            "--type=json",
            "-p",
            '[{"op": "remove", "path": "/metadata/finalizers"}]',
        )
        cluster.kubectl("delete", "pod", "held", "-n", namespace, "--wait=true", "--timeout=60s")
        # A network's finalizer can be removed, and its status written; its spec cannot change.
        cluster.kubectl(
            "patch",
            "metarocenetwork",
            net,
            "--type=merge",
            "-p",
            '{"metadata": {"finalizers": ["example.com/x"]}}',
        )
        cluster.kubectl(
            "patch",
            "metarocenetwork",
            net,
            "--type=json",
            "-p",
            '[{"op": "remove", "path": "/metadata/finalizers"}]',
        )
        running.set_healthy(net, 2)
        proc = cluster.kubectl(
            "patch",
            "metarocenetwork",
            net,
            "--type=merge",
            "-p",
            '{"spec": {"transport": {"retryCount": 6}}}',
            check=False,
        )
        assert (
            proc.returncode != 0 and 'failed calling webhook "networks.metaroce.io"' in proc.stderr
        )
    finally:
        running.start_replica()
    running.wait_cached(net)
    create(cluster, namespace, pod_manifest("after", net))


def test_certificate_rotation_causes_no_failed_admission(
    running: WebhookEnv, namespace: str
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(running.cluster.api_client())
    net = f"be-{running.tag}"
    results = {"ok": 0, "failed": []}  # type: dict[str, Any]
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                got = core.create_namespaced_pod(
                    namespace, pod_manifest(f"rot-{i}", net), dry_run="All"
                )
                assert got.metadata.annotations["metaroce.io/injected"]
                results["ok"] += 1
            except ApiException as exc:
                results["failed"].append(str(exc.body)[:300])
            time.sleep(0.05)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        time.sleep(1)
        before = running.served_serial()
        # 1. the serving certificate is re-issued by the same CA
        assert running.lead_certificates(force=True)
        assert running.bundle is not None
        first = running.bundle.serving_cert().serial_number
        assert first != before
        wait_for(
            "the replica to serve the new certificate", lambda: running.served_serial() == first
        )
        time.sleep(1)
        # 2. a CA rotation: the new CA is published, then used
        assert running.lead_certificates(force_ca=True)
        assert len(running.bundle.cas()) == 2
        time.sleep(2)  # the apiserver picks up the new caBundle
        assert running.lead_certificates(force=True)
        second = running.bundle.serving_cert().serial_number
        wait_for(
            "the replica to serve the new CA's certificate",
            lambda: running.served_serial() == second,
        )
        time.sleep(2)
    finally:
        stop.set()
        thread.join(10)
    assert results["failed"] == [], results["failed"][:3]
    assert results["ok"] > 40, f"only {results['ok']} admissions during the rotation"


def test_caches_read_the_real_api(running: WebhookEnv, namespace: str) -> None:
    from metaroce_operator.kube import load_credentials
    from metaroce_operator.webhooks.apiloop import ApiLoop
    from metaroce_operator.webhooks.cache import NamespaceLabels, NodeLabels

    api = ApiLoop(load_credentials(str(running.cluster.kubeconfig)))
    try:
        nodes = NodeLabels(api).get()
        assert nodes is not None, "the metadata-only node list failed (see the log)"
        assert set(running.nodes) <= set(nodes)
        assert nodes[running.nodes[0]]["webhook-test"] == running.tag
        labels = NamespaceLabels(api).get(namespace)
        assert labels is not None and labels["kubernetes.io/metadata.name"] == namespace
        assert NamespaceLabels(api).get("no-such-namespace-here") is None
    finally:
        api.stop()
