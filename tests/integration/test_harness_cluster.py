"""The local control plane is real: scheduling, controllers, CRDs, GC, webhooks, helm."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_harness.cluster import FakeNode, HarnessError, LocalCluster, free_port
from metaroce_harness.polling import wait_for

HERE = Path(__file__).parent


def pods(cluster: LocalCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def apply(cluster: LocalCluster, *docs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def test_deployment_pods_run_on_kwok_nodes(cluster: LocalCluster, namespace: str) -> None:
    apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": namespace},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/web:1"}]},
                },
            },
        },
    )

    def running() -> list[dict[str, Any]]:
        items = pods(cluster, namespace, "app=web")
        ok = [p for p in items if p["status"].get("phase") == "Running"]
        return ok if len(ok) == 3 else []

    items = wait_for("3 Running pods", running)
    assert {p["spec"]["nodeName"] for p in items} <= {"kwok-a1", "kwok-a2", "kwok-b1"}


def test_daemonset_gets_one_pod_per_matching_node(cluster: LocalCluster, namespace: str) -> None:
    apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "agent", "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "agent"}},
                "template": {
                    "metadata": {"labels": {"app": "agent"}},
                    "spec": {
                        "nodeSelector": {"harness.metaroce.io/pool": "a"},
                        "containers": [{"name": "c", "image": "registry.invalid/agent:1"}],
                    },
                },
            },
        },
    )

    def placed() -> list[str]:
        items = [
            p
            for p in pods(cluster, namespace, "app=agent")
            if p["status"].get("phase") == "Running"
        ]
        return sorted(p["spec"]["nodeName"] for p in items) if len(items) >= 2 else []

    assert wait_for("DaemonSet pods on pool a", placed) == ["kwok-a1", "kwok-a2"]
    time.sleep(2)  # no late extra pod on a non-matching node
    assert sorted(p["spec"]["nodeName"] for p in pods(cluster, namespace, "app=agent")) == [
        "kwok-a1",
        "kwok-a2",
    ]


def test_extended_resource_pods_land_only_where_it_is_allocatable(
    cluster: LocalCluster, namespace: str
) -> None:
    def pod(name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": "widget"}},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.invalid/w:1",
                        "resources": {
                            "requests": {"example.com/widget": "1"},
                            "limits": {"example.com/widget": "1"},
                        },
                    }
                ]
            },
        }

    apply(cluster, pod("w1"), pod("w2"), pod("w3"))

    def settled() -> dict[str, str]:
        items = pods(cluster, namespace, "app=widget")
        placed = {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in items}
        return placed if sum(1 for n in placed.values() if n) == 2 else {}

    placed = wait_for("two widget pods scheduled", settled)
    assert sorted(n for n in placed.values() if n) == ["kwok-a1", "kwok-a1"]
    time.sleep(2)
    unscheduled = [
        p for p in pods(cluster, namespace, "app=widget") if not p["spec"].get("nodeName")
    ]
    assert len(unscheduled) == 1, "only 2 widgets are allocatable: the third pod must stay Pending"
    reasons = json.dumps(unscheduled[0]["status"].get("conditions", []))
    assert "Insufficient example.com/widget" in reasons


def test_crd_applied_with_kubectl_is_established_and_serves_objects(cluster: LocalCluster) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "gadgets.harness.metaroce.io"},
        "spec": {
            "group": "harness.metaroce.io",
            "scope": "Cluster",
            "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {"size": {"type": "integer", "maximum": 10}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    apply(cluster, crd)
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/gadgets.harness.metaroce.io", "--timeout=30s"
    )
    gadget = {
        "apiVersion": "harness.metaroce.io/v1",
        "kind": "Gadget",
        "metadata": {"name": "g1"},
        "spec": {"size": 3},
    }
    apply(cluster, gadget)
    got = json.loads(cluster.kubectl("get", "gadget", "g1", "-o", "json").stdout)
    assert got["spec"]["size"] == 3
    bad = cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump({**gadget, "metadata": {"name": "g2"}, "spec": {"size": 11}}),
        check=False,
    )
    assert bad.returncode != 0 and "spec.size" in bad.stderr
    cluster.kubectl("delete", "crd", "gadgets.harness.metaroce.io")


def test_deleting_an_owner_garbage_collects_its_dependents(
    cluster: LocalCluster, namespace: str
) -> None:
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "owner", "namespace": namespace},
        },
    )
    uid = cluster.kubectl(
        "get", "cm", "owner", "-n", namespace, "-o", "jsonpath={.metadata.uid}"
    ).stdout
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "dependent",
                "namespace": namespace,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
                ],
            },
        },
    )
    cluster.kubectl("delete", "cm", "owner", "-n", namespace)
    wait_for(
        "the dependent to be garbage-collected",
        lambda: (
            cluster.kubectl("get", "cm", "dependent", "-n", namespace, check=False).returncode != 0
        ),
    )


def _start_echo(
    cluster: LocalCluster, *, in_pod_network: bool, tag: str
) -> tuple[int, Callable[[], None]]:
    """Start webhook_echo.py on loopback or in the pod network; returns (port, stop)."""
    assert cluster.pod_network is not None
    port = free_port()
    if in_pod_network:
        host = cluster.pod_network.pod_ip
        pair = cluster.issue_serving_cert(f"echo-{tag}", dns_names=(f"{tag}.{tag}-ns.svc",))
    else:
        host = "127.0.0.1"
        pair = cluster.issue_serving_cert(f"echo-{tag}", ip_addresses=("127.0.0.1",))
    argv = [
        sys.executable,
        str(HERE / "webhook_echo.py"),
        "--cert",
        str(pair.cert),
        "--key",
        str(pair.key),
    ]
    argv += ["--host", host, "--port", str(port), "--tag", tag]
    if in_pod_network:
        component = cluster.pod_network.popen(argv, log_name=f"webhook-{tag}")
        return port, component.stop
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return port, proc.kill


def test_mutating_webhook_is_called_by_url_and_through_a_service(
    cluster: LocalCluster, namespace: str
) -> None:
    url_port, stop_url = _start_echo(cluster, in_pod_network=False, tag="loopback")
    svc_port, stop_svc = _start_echo(cluster, in_pod_network=True, tag="svc")
    cluster.kubectl("create", "namespace", "svc-ns")
    cluster.expose_in_pod_network("svc-ns", "svc", port=443, target_port=svc_port)
    bundle = base64.b64encode(cluster.ca.pair.cert_pem()).decode()
    scope = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    rules = [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["configmaps"],
        }
    ]
    common = {
        "rules": rules,
        "namespaceSelector": scope,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "failurePolicy": "Fail",
        "timeoutSeconds": 5,
    }
    loopback = {"url": f"https://127.0.0.1:{url_port}/mutate", "caBundle": bundle}
    service = {
        "service": {"namespace": "svc-ns", "name": "svc", "port": 443, "path": "/mutate"},
        "caBundle": bundle,
    }
    apply(
        cluster,
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": f"harness-echo-{namespace}"},
            "webhooks": [
                {"name": "loopback.harness.metaroce.io", "clientConfig": loopback, **common},
                {"name": "svc.harness.metaroce.io", "clientConfig": service, **common},
            ],
        },
    )

    def created() -> dict[str, str]:
        name = f"probe-{int(time.monotonic() * 1000)}"
        proc = cluster.kubectl(
            "create", "configmap", name, "-n", namespace, "-o", "json", check=False
        )
        if proc.returncode != 0:
            return {}
        annotations: dict[str, str] = json.loads(proc.stdout)["metadata"].get("annotations", {})
        return annotations

    try:
        annotations = wait_for("both webhooks to answer", created, timeout=30)
        assert annotations.get("harness.metaroce.io/loopback") == "called"
        assert annotations.get("harness.metaroce.io/svc") == "called"
    finally:
        cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", f"harness-echo-{namespace}", check=False
        )
        cluster.kubectl("delete", "namespace", "svc-ns", "--wait=false", check=False)
        stop_url()
        stop_svc()


def test_helm_installs_a_tiny_chart(cluster: LocalCluster, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        textwrap.dedent(
            """\
            apiVersion: v1
            kind: ConfigMap
            metadata:
              name: {{ .Release.Name }}-cm
            data:
              greeting: {{ .Values.greeting | quote }}
            """
        )
    )
    cluster.helm("install", "tiny", str(chart), "-n", namespace, "--set", "greeting=hi", "--wait")
    data = cluster.kubectl(
        "get", "cm", "tiny-cm", "-n", namespace, "-o", "jsonpath={.data.greeting}"
    ).stdout
    assert data == "hi"
    cluster.helm("uninstall", "tiny", "-n", namespace, "--wait")
    assert cluster.kubectl("get", "cm", "tiny-cm", "-n", namespace, check=False).returncode != 0


def test_new_node_with_taint_and_extended_resource_is_honoured(
    cluster: LocalCluster, namespace: str
) -> None:
    taint = {"key": "harness.metaroce.io/dedicated", "value": "rdma", "effect": "NoSchedule"}
    cluster.add_nodes(
        [
            FakeNode(
                "kwok-t1",
                labels={"harness.metaroce.io/pool": "t"},
                capacity={"example.com/gizmo": "1"},
                taints=[taint],
            )
        ]
    )
    node = json.loads(cluster.kubectl("get", "node", "kwok-t1", "-o", "json").stdout)
    assert node["status"]["allocatable"]["example.com/gizmo"] == "1"
    assert node["spec"]["taints"][0]["key"] == taint["key"]
    cluster.kubectl("delete", "node", "kwok-t1")


@pytest.mark.parametrize("fault", ["port-in-use", "crash"])
def test_component_failures_name_the_component_and_its_log(fault: str) -> None:
    import socket

    holder = socket.socket()
    try:
        if fault == "port-in-use":
            holder.bind(("0.0.0.0", 0))
            holder.listen()
            extra = [f"--secure-port={holder.getsockname()[1]}"]
        else:
            extra = ["--no-such-flag-for-test"]
        broken = LocalCluster(start_timeout=30, extra_apiserver_args=extra)
        with pytest.raises(HarnessError) as err:
            broken.start()
        message = str(err.value)
        assert "kube-apiserver" in message
        assert "kube-apiserver.log" in message
        if fault == "port-in-use":
            assert "in use" in message
    finally:
        holder.close()
