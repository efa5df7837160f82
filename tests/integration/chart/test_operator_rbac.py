"""The operator's own privileges (issue 16 #13), as the real apiserver enforces them.

The chart's RBAC and its ValidatingAdmissionPolicy are applied to the cluster, and the
operator's ServiceAccount (impersonated: RBAC and the policy see its user name) tries
what a compromised operator would: grant its own role to others, edit a ClusterRole,
bind a role other than the agents', bind the agents' role to anyone but an agent, and
edit a Node beyond the `metaroce.io/*` taints. What the operator does for real (bind
the agents' ClusterRole to an agent ServiceAccount, set and clear its taints) passes.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from metaroce_harness import chart
from metaroce_harness.cluster import LocalCluster

KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


class Installed:
    def __init__(self, cluster: LocalCluster, namespace: str, release: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.release = release
        self.user = f"system:serviceaccount:{namespace}:{release}"
        self.node = f"rbac-{secrets.token_hex(3)}"

    def as_operator(self, *args: str, input: str | None = None) -> tuple[bool, str]:
        proc = self.cluster.kubectl(f"--as={self.user}", *args, input=input, check=False)
        return proc.returncode == 0, proc.stderr

    def binding(self, role: str, subjects: list[dict[str, Any]]) -> str:
        return json.dumps(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{self.release}-try-{secrets.token_hex(3)}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role,
                },
                "subjects": subjects,
            }
        )

    def patch_as_operator(self, kind: str, name: str, body: Any) -> tuple[bool, str]:
        """A PATCH as the operator sends it (kubectl patch GETs first, which the operator
        may not do for Secrets): the operator's own client, as its user."""
        from metaroce_operator.kube import KINDS, ApiError, Kube, load_credentials

        creds = load_credentials(str(self.cluster.kubeconfig_for(self.user)))

        async def patch() -> None:
            kube = Kube(creds)
            try:
                await kube.patch(KINDS[("v1", kind)], name, body, namespace=self.namespace)
            finally:
                await kube.close()

        try:
            asyncio.run(patch())
        except ApiError as err:
            return False, str(err)
        return True, ""

    def agent(self, name: str = "metaroce-agent-net") -> dict[str, Any]:
        return {"kind": "ServiceAccount", "name": name, "namespace": self.namespace}


@pytest.fixture
def installed(cluster: LocalCluster, namespace: str) -> Iterator[Installed]:
    release = f"metaroce-rb-{secrets.token_hex(3)}"
    docs = chart.render(cluster, release, {"namespace": {"name": namespace, "create": False}})
    ours = [d for d in docs if d["kind"] in KINDS]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(ours))
    inst = Installed(cluster, namespace, release)
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": inst.node}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(node))
    try:
        yield inst
    finally:
        cluster.kubectl("delete", "node", inst.node, "--wait=false", check=False)
        cluster.kubectl("delete", "-f", "-", "--wait=false", input=yaml.safe_dump_all(ours),
                        check=False)  # fmt: skip
        left = cluster.kubectl("get", "clusterrolebindings", "-o", "name").stdout.split()
        for name in left:
            if name.startswith(f"clusterrolebinding.rbac.authorization.k8s.io/{release}-try-"):
                cluster.kubectl("delete", name, "--wait=false", check=False)


def _policy_ready(inst: Installed) -> None:
    """A new policy takes a moment to be enforced: wait until a refused write is refused."""
    from metaroce_harness.polling import wait_for

    def refused() -> bool:
        ok, _ = inst.as_operator(
            "label", "node", inst.node, "probe-policy=1", "--overwrite", "--dry-run=server"
        )
        return not ok

    wait_for("the operator's ValidatingAdmissionPolicy to apply", refused, timeout=30)


def test_the_operator_cannot_grant_its_own_role_or_edit_cluster_roles_issue_16_13(
    installed: Installed,
) -> None:
    inst = installed
    _policy_ready(inst)
    own_role = f"{inst.release}-operator"
    ok, err = inst.as_operator(
        "create", "-f", "-", input=inst.binding(own_role, [inst.agent("anyone")])
    )
    assert not ok, "the operator could bind its own ClusterRole to another ServiceAccount"
    victim = f"{inst.release}-victim"
    inst.cluster.kubectl("create", "clusterrole", victim, "--verb=get", "--resource=pods")
    try:
        rule = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}
        patch = json.dumps([{"op": "add", "path": "/rules/-", "value": rule}])
        ok, err = inst.as_operator("patch", "clusterrole", victim, "--type=json", "-p", patch)
        assert not ok and "forbidden" in err.lower(), err
    finally:
        inst.cluster.kubectl("delete", "clusterrole", victim, "--wait=false", check=False)


def test_the_operator_binds_only_the_agents_role_to_agents_issue_16_13(
    installed: Installed,
) -> None:
    inst = installed
    _policy_ready(inst)
    agent_role = f"{inst.release}-agent"
    ok, err = inst.as_operator("create", "-f", "-", input=inst.binding(agent_role, [inst.agent()]))
    assert ok, err
    for subjects in (
        [
            {
                "kind": "Group",
                "name": "system:authenticated",
                "apiGroup": "rbac.authorization.k8s.io",
            }
        ],
        [{"kind": "ServiceAccount", "name": "metaroce-agent-net", "namespace": "default"}],
        [inst.agent(), {"kind": "ServiceAccount", "name": "default", "namespace": inst.namespace}],
    ):
        ok, err = inst.as_operator("create", "-f", "-", input=inst.binding(agent_role, subjects))
        assert not ok, f"the operator bound the agents' role to {subjects}"
        assert "agent" in err, err


def test_the_operator_changes_only_its_own_taints_on_nodes_issue_16_13(
    installed: Installed,
) -> None:
    inst = installed
    _policy_ready(inst)
    taint = {"key": "metaroce.io/rdma-unhealthy", "value": "net", "effect": "NoSchedule"}

    def write_taints(taints: list[dict[str, Any]]) -> tuple[bool, str]:
        # As taints.py does: the node's other taints (the node lifecycle controller's
        # not-ready ones on this kubelet-less Node) are kept, under its resourceVersion;
        # a controller may update the Node between the read and the patch: read again.
        for _ in range(5):
            node = json.loads(inst.cluster.kubectl("get", "node", inst.node, "-o", "json").stdout)
            others = [t for t in node["spec"].get("taints") or [] if t["key"] != taint["key"]]
            patch = {
                "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "spec": {"taints": others + taints},
            }
            ok, err = inst.as_operator(
                "patch", "node", inst.node, "--type=merge", "-p", json.dumps(patch)
            )
            if ok or "modified" not in err:
                break
        return ok, err

    ok, err = write_taints([taint])
    assert ok, err
    ok, err = write_taints([])
    assert ok, err
    for patch in (
        {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
        {"spec": {"unschedulable": True}},
        {"spec": {"taints": [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]}},
    ):
        ok, err = inst.as_operator(
            "patch", "node", inst.node, "--type=merge", "-p", json.dumps(patch)
        )
        assert not ok, f"the operator could patch a Node with {patch}"
        assert "metaroce.io/" in err, err


def test_the_operator_writes_only_probe_key_secrets_and_its_certificate_issue_15_7(
    installed: Installed,
) -> None:
    """Issue 15 finding 7 (operator side): the operator creates each network's probe-key
    Secret and later patches its metadata; its namespace-wide Secret create and patch
    reach nothing else (image pull Secrets, Helm's release Secrets), and it reads none."""
    inst = installed
    _policy_ready(inst)
    ns = inst.namespace
    name = f"metaroce-agent-rb-{secrets.token_hex(3)}"

    def secret(name: str, type_: str) -> str:
        return json.dumps({
            "apiVersion": "v1", "kind": "Secret", "type": type_,
            "metadata": {"name": name, "namespace": ns},
            "data": {"key": "a2V5", "previous": "a2V5"},
        })  # fmt: skip

    ok, err = inst.as_operator("create", "-f", "-", input=secret(name, "metaroce.io/probe-key"))
    assert ok, err
    labels = {"metadata": {"labels": {"metaroce.io/network": "rb"}}}
    ok, err = inst.patch_as_operator("Secret", name, labels)
    assert ok, err
    ok, err = inst.as_operator("get", "secret", name, "-n", ns)
    assert not ok and "forbidden" in err.lower(), "the operator may read Secrets"
    for bad in (
        secret(f"metaroce-agent-rb-{secrets.token_hex(3)}", "Opaque"),
        secret(f"regcred-{secrets.token_hex(3)}", "metaroce.io/probe-key"),
    ):
        ok, err = inst.as_operator("create", "-f", "-", input=bad)
        assert not ok and "probe-key" in err, f"the operator created {bad}: {err}"
    helm = f"sh.helm.release.v1.rb-{secrets.token_hex(3)}.v1"
    inst.cluster.kubectl("create", "secret", "generic", helm, "-n", ns, "--from-literal=a=b")
    ok, err = inst.patch_as_operator("Secret", helm, labels)
    assert not ok and "probe-key" in err, f"the operator patched Helm's release Secret: {err}"
    other = f"metaroce-agent-rb-{secrets.token_hex(3)}"  # the right name, the wrong type
    inst.cluster.kubectl("create", "secret", "generic", other, "-n", ns, "--from-literal=a=b")
    ok, err = inst.patch_as_operator("Secret", other, labels)
    assert not ok and "probe-key" in err, err
    inst.cluster.kubectl("delete", "secret", name, helm, other, "-n", ns, "--wait=false",
                         check=False)  # fmt: skip


def test_the_operator_sets_only_its_networks_node_labels_issue_15_4(installed: Installed) -> None:
    """Issue 15 finding 4: the operator manages `metaroce.io/agent-<network>` on Nodes
    (the label that keeps an agent until it reverted its node); no other label, not even
    a user's own `metaroce.io/*` selection label."""
    inst = installed
    _policy_ready(inst)
    for value in ("selected", "revert", None):
        patch = {"metadata": {"labels": {"metaroce.io/agent-net": value}}}
        ok, err = inst.as_operator(
            "patch", "node", inst.node, "--type=merge", "-p", json.dumps(patch)
        )
        assert ok, err
    for labels in ({"metaroce.io/rdma": "true"}, {"kubernetes.io/hostname": "x"},
                   {"metaroce.io/agent-net": "selected", "zone": "a"}):  # fmt: skip
        patch = {"metadata": {"labels": labels}}
        ok, err = inst.as_operator(
            "patch", "node", inst.node, "--type=merge", "-p", json.dumps(patch)
        )
        assert not ok, f"the operator could set the labels {labels}"
        assert "metaroce.io/agent-" in err, err


def test_the_operator_sets_only_its_networks_pod_blocks_on_nodes_issue_14(
    installed: Installed,
) -> None:
    """Issue 14: the operator records each node's block of a network's pod subnet as the
    annotation `podnet.metaroce.io/<network>`; no other annotation."""
    inst = installed
    _policy_ready(inst)
    for value in ("10.56.0.0/24", "10.56.1.0/24", None):
        patch = {"metadata": {"annotations": {"podnet.metaroce.io/net": value}}}
        ok, err = inst.as_operator(
            "patch", "node", inst.node, "--type=merge", "-p", json.dumps(patch)
        )
        assert ok, err
    for wrong in ({"metaroce.io/x": "1"}, {"node.alpha.kubernetes.io/ttl": "5"},
                  {"podnet.metaroce.io/net": "10.56.0.0/24", "zone": "a"}):  # fmt: skip
        patch = {"metadata": {"annotations": wrong}}
        ok, err = inst.as_operator(
            "patch", "node", inst.node, "--type=merge", "-p", json.dumps(patch)
        )
        assert not ok, f"the operator could set the annotations {wrong}"
        assert "podnet.metaroce.io/" in err, err
