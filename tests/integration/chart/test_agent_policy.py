"""The chart's agent NodeState policy on the real apiserver (issue 16 #12).

An agent's credentials, as the kubelet makes them: a TokenRequest bound to the agent's
pod on one (kwok) node, so the token names that node. With that token the agent may
write its own node's NodeState of its own network, and nothing else: not create
another node's or another network's, not overwrite or delete a peer's report (moving
its own to another node is refused by the CRD: spec is immutable). Fails on b6733c0
(no policy).
"""

from __future__ import annotations

import base64
import json
import secrets
from pathlib import Path
from typing import Any

import yaml

from metaroce_api import constants as c
from metaroce_api.examples import minimal_nodestate
from metaroce_harness import chart
from metaroce_harness.cluster import LocalCluster
from metaroce_harness.polling import wait_for
from metaroce_operator.render.common import child_name

CRD_DIR = Path(__file__).resolve().parents[3] / "crds"
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def _token_kubeconfig(cluster: LocalCluster, token: str, path: Path) -> Path:
    ca = base64.b64encode(cluster.ca.pair.cert_pem()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "l", "cluster": {"server": cluster.server, "certificate-authority-data": ca}}
        ],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "agent", "context": {"cluster": "l", "user": "agent"}}],
        "current-context": "agent",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def test_an_agent_writes_only_its_own_node_s_nodestate(
    cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))
    tag = secrets.token_hex(3)
    release = f"pol-{tag}"
    docs = chart.render(
        cluster,
        release,
        {
            "namespace": {"name": namespace, "create": False},
            "agent": {"nodeStatePolicy": {"enabled": True}},
        },
    )
    policy = [
        d
        for d in docs
        if d["kind"] in POLICY_KINDS and d["metadata"]["name"].endswith("-agent-nodestates")
    ]
    assert [d["kind"] for d in policy] == list(POLICY_KINDS), "the chart ships no agent policy"
    network, other = f"pol{tag}", f"other{tag}"
    account = child_name(network)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"{release}-agent"},
        "rules": [
            {
                "apiGroups": [c.GROUP],
                "resources": [c.NODESTATE_PLURAL],
                "verbs": ["get", "create", "update", "patch", "delete"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": f"{release}-agent"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{release}-agent",
        },
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent", "namespace": namespace},
        "spec": {
            "nodeName": "kwok-a1",
            "serviceAccountName": account,
            "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}],
        },
    }
    try:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([*policy, role, binding]))
        cluster.kubectl("create", "serviceaccount", account, "-n", namespace)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        token = cluster.kubectl(
            "create", "token", account, "-n", namespace, "--duration=10m",
            "--bound-object-kind=Pod", "--bound-object-name=agent",
        ).stdout.strip()  # fmt: skip
        as_agent = _token_kubeconfig(cluster, token, tmp_path / "agent.kubeconfig")
        whoami = json.loads(
            cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig=as_agent).stdout
        )
        extra = whoami["status"]["userInfo"].get("extra") or {}
        assert extra.get("authentication.kubernetes.io/node-name") == ["kwok-a1"], whoami

        def write(body: dict[str, Any], verb: str = "create") -> Any:
            return cluster.kubectl(
                verb, "-f", "-", input=json.dumps(body), kubeconfig=as_agent, check=False
            )

        # The policy takes a moment to reach the apiserver's admission: retry the refusal.
        foreign = minimal_nodestate(network, "kwok-a2")
        wait_for(
            "the policy to refuse another node's NodeState",
            lambda: "may write only the NodeState of its own node" in write(foreign).stderr,
            timeout=30,
        )
        theirs = minimal_nodestate(other, "kwok-a1")
        proc = write(theirs)
        assert proc.returncode != 0 and "belongs to another network" in proc.stderr, proc.stderr
        misnamed = minimal_nodestate(network, "kwok-a1")
        misnamed["metadata"]["name"] = f"{network}.kwok-a2"
        proc = write(misnamed)
        assert proc.returncode != 0 and "is named <spec.network>.<spec.node>" in proc.stderr

        own = minimal_nodestate(network, "kwok-a1")
        proc = write(own)
        assert proc.returncode == 0, proc.stderr
        report = json.dumps({"status": {"phase": "Reverted", "reverted": True}})
        proc = cluster.kubectl(
            "patch", c.NODESTATE_PLURAL, own["metadata"]["name"], "--type=merge", "-p", report,
            kubeconfig=as_agent, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        # A peer's report (written by its own agent; here by an admin, who is not matched):
        # overwriting it to say "reverted" or "healthy", or deleting it, is refused.
        peer = minimal_nodestate(network, "kwok-a2")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(peer))
        proc = cluster.kubectl(
            "patch", c.NODESTATE_PLURAL, peer["metadata"]["name"], "--type=merge", "-p", report,
            kubeconfig=as_agent, check=False,
        )  # fmt: skip
        assert proc.returncode != 0 and "its own node" in proc.stderr, proc.stderr
        proc = cluster.kubectl(
            "delete", c.NODESTATE_PLURAL, peer["metadata"]["name"],
            kubeconfig=as_agent, check=False,
        )  # fmt: skip
        assert proc.returncode != 0 and "its own node" in proc.stderr, proc.stderr
    finally:
        for body in (minimal_nodestate(network, "kwok-a1"), minimal_nodestate(network, "kwok-a2")):
            cluster.kubectl(
                "delete",
                c.NODESTATE_PLURAL,
                body["metadata"]["name"],
                "--ignore-not-found",
                check=False,
            )
        for doc in [*policy, role, binding]:
            cluster.kubectl(
                "delete",
                doc["kind"].lower(),
                doc["metadata"]["name"],
                "--ignore-not-found",
                check=False,
            )
