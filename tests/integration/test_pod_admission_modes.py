"""Pod admission in both modes of the chart, on the real apiserver, with the same cases
(tests/fixtures/admission_cases.py, which the unit tier runs through the webhook's pure
mutation too):

- `webhook`: the chart's MutatingWebhookConfiguration, the apiserver calling the pod
  webhook of a replica over TLS;
- `policy`: no pod webhook; each network's MutatingAdmissionPolicy + binding (rendered by
  `render_pod_policy`, applied as the operator applies them) run inside the apiserver, and
  the chart's ValidatingAdmissionPolicy refuses.

Then what differs when the operator is down: with the webhook, annotated pods fail
closed; with policies they are admitted with the full mutation, and a network deleted
meanwhile takes its policy with it (ownerReferences + the garbage collector).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_webhooks_env import WebhookEnv, injected_networks, pod_manifest, wait_for

from metaroce_api import constants as c
from metaroce_harness.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from admission_cases import BE_SPEC, CASES, Case, Names, fe_spec

MODES = ["webhook", "policy"]
MR_SPEC: dict[str, Any] = {
    "transport": {"mode": "metaroce"},
    "qos": {"profile": "lossy"},
    "attachment": {"podNetwork": {"subnet": "10.56.0.0/16"}},
}
"""A metaroce network whose pods get a Multus secondary interface (issue 14)."""
MULTUS = "k8s.v1.cni.cncf.io/networks"


def mr_name(tag: str) -> str:
    return f"mr-{tag}"


LEVELS = [None, "privileged", "baseline", "restricted"]


class ModeEnv:
    def __init__(self, env: WebhookEnv, names: Names, namespaces: dict[str | None, str]) -> None:
        self.env = env
        self.names = names
        self.namespaces = namespaces

    @property
    def cluster(self) -> LocalCluster:
        return self.env.cluster

    def create(
        self, body: dict[str, Any], namespace: str, *, dry_run: bool = True
    ) -> tuple[dict[str, Any] | None, str]:
        """(the stored pod, "") or (None, the refusal)."""
        args = ["create", "-n", namespace, "-o", "json", "-f", "-"]
        if dry_run:
            args.append("--dry-run=server")
        proc = self.cluster.kubectl(*args, input=json.dumps(body), check=False)
        if proc.returncode != 0:
            return None, proc.stderr
        return json.loads(proc.stdout), ""

    def refusal_source(self) -> str:
        if self.env.mode == "webhook":
            return 'admission webhook "pods.metaroce.io" denied the request'
        return f"ValidatingAdmissionPolicy '{self.env.pod_policy}'"


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[ModeEnv]:
    env = WebhookEnv(cluster, mode=request.param)
    names = Names(f"be-{env.tag}", f"fe-{env.tag}")
    namespaces: dict[str | None, str] = {}
    try:
        env.install()
        env.add_resource_nodes(names.be)
        env.create_network(names.be, healthy=2, **BE_SPEC)
        env.create_network(names.fe, healthy=2, **fe_spec(names.r_fe))
        env.create_network(mr_name(env.tag), healthy=2, **MR_SPEC)
        for level in LEVELS:
            ns = f"adm-{env.tag}-{level or 'none'}"
            cluster.kubectl("create", "namespace", ns)
            if level:
                cluster.kubectl(
                    "label", "namespace", ns, f"pod-security.kubernetes.io/enforce={level}"
                )
            namespaces[level] = ns
        env.wait_cached(names.be)
        env.wait_cached(names.fe)
        env.wait_cached(mr_name(env.tag))
        yield ModeEnv(env, names, namespaces)
    finally:
        for ns in namespaces.values():
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        env.teardown()


@pytest.fixture
def running(mode: ModeEnv) -> ModeEnv:
    """The mode with its webhook replica up (a test before may have stopped it)."""
    if mode.env.replica is None:
        mode.env.start_replica()
    return mode


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(running: ModeEnv, case: Case) -> None:
    names = running.names
    pod, refusal = running.create(
        case.pod(names, f"c-{case.id}"), running.namespaces[case.pod_security]
    )
    if case.refused:
        assert pod is None, f"admitted: {json.dumps(pod)[:2000]}"
        assert running.refusal_source() in refusal, refusal
        for word in case.refused:
            assert names.fill(word) in refusal, refusal
        return
    assert pod is not None, refusal
    assert case.check is not None
    case.check(pod, names)
    if case.networks is not None:
        wanted = {n.strip() for n in names.fill(case.networks).split(",")}
        assert set(injected_networks(pod["metadata"]["annotations"])) == wanted


def test_a_mutated_pod_created_again_is_unchanged(running: ModeEnv) -> None:
    """Idempotent: the webhook adds nothing already there; a policy skips a pod that
    carries its record (the guard), so reinvocation or a copied pod adds no env twice."""
    names = running.names
    ns = running.namespaces[None]
    first, refusal = running.create(pod_manifest("again", f"{names.fe},{names.be}"), ns)
    assert first is not None, refusal

    def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
        # Without the ServiceAccount token mount the apiserver adds to every pod.
        return [
            {k: v for k, v in ctr.items() if k != "volumeMounts"}
            for ctr in pod["spec"]["containers"]
        ]

    copy = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "again-2", "annotations": first["metadata"]["annotations"]},
        "spec": {"containers": containers(first)},
    }
    second, refusal = running.create(copy, ns)
    assert second is not None, refusal
    assert containers(second) == containers(first)
    assert second["metadata"]["annotations"] == first["metadata"]["annotations"]


def _what_admission_sets(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """Per container: env, limits, added capabilities (what the mutation is about)."""
    return [
        {
            "env": {e["name"]: e.get("value") for e in ctr.get("env") or []},
            "limits": (ctr.get("resources") or {}).get("limits") or {},
            "add": ((ctr.get("securityContext") or {}).get("capabilities") or {}).get("add"),
        }
        for ctr in pod["spec"]["containers"]
    ]


def test_inject_dry_run_shows_what_admission_does(running: ModeEnv) -> None:
    """Issue 17: `metaroce inject --dry-run -f pod.yaml`, reading the networks and the
    namespace from the cluster as a user runs it, predicts the containers the apiserver
    stores, with the webhook and with the policies alike (two networks, a sidecar)."""
    import jsonpatch  # type: ignore[import-untyped]

    names = running.names
    ns = running.namespaces["privileged"]
    pod = pod_manifest("preview", f"{names.fe},{names.be}")
    pod["spec"]["containers"].append({"name": "sidecar", "image": "registry.invalid/log:1"})
    done = subprocess.run(
        [sys.executable, "-m", "metaroce_cli.main", "inject", "--dry-run", "-f", "-",
         "--namespace", ns],
        input=json.dumps(pod), env={**os.environ, "KUBECONFIG": str(running.cluster.kubeconfig)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    predicted = jsonpatch.apply_patch(pod, json.loads(done.stdout))
    stored, refusal = running.create(pod, ns)
    assert stored is not None, refusal
    assert _what_admission_sets(predicted) == _what_admission_sets(stored)
    assert _what_admission_sets(stored)[0]["limits"]  # it did inject


def test_operator_stopped(running: ModeEnv) -> None:
    names, env = running.names, running.env
    ns = running.namespaces[None]
    env.stop_replica()
    try:
        plain, _ = running.create(pod_manifest("plain", None), ns, dry_run=False)
        assert plain is not None and "env" not in plain["spec"]["containers"][0]
        pod, refusal = running.create(pod_manifest("down", names.be), ns, dry_run=False)
        if env.mode == "webhook":
            # The pod webhook fails closed, and the error names it.
            assert pod is None and 'failed calling webhook "pods.metaroce.io"' in refusal
            return
        # Policies run in the apiserver: the full mutation, nothing depends on the operator.
        assert pod is not None, refusal
        main = pod["spec"]["containers"][0]
        assert main["resources"]["limits"] == {names.r_be: "1"}
        assert main["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert {e["name"] for e in main["env"]} == {
            "NCCL_IB_TC",
            "NCCL_IB_QPS_PER_CONNECTION",
            "NCCL_IB_TIMEOUT",
            "NCCL_IB_RETRY_CNT",
        }
        record = json.loads(pod["metadata"]["annotations"][f"injected.metaroce.io/{names.be}"])
        assert record["container"] == "main" and record["env"]["NCCL_IB_TC"] == "104"
        _, refusal = running.create(pod_manifest("nosuch", "nosuch"), ns)
        assert "does not exist" in refusal
    finally:
        env.start_replica()
        running.cluster.kubectl(
            "delete", "pod", "plain", "down", "-n", ns, "--wait=false", check=False
        )


def test_network_deleted_while_the_operator_is_stopped_leaves_no_policy(
    running: ModeEnv,
) -> None:
    env = running.env
    name = f"gone-{env.tag}"
    env.create_network(name, healthy=0)
    env.wait_cached(name)
    if env.mode == "webhook":
        # Never both: in webhook mode no policy mutates the network's pods.
        assert env.pod_policy_objects(name) == []
        return
    assert env.pod_policy_objects(name) == [
        "mutatingadmissionpolicy",
        "mutatingadmissionpolicybinding",
    ]
    ns = running.namespaces[None]
    env.stop_replica()
    try:
        running.cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--wait=true", "--timeout=60s")
        # The garbage collector (kube-controller-manager) deletes what the network owned.
        wait_for(
            "the garbage collector to delete the policy",
            lambda: not env.pod_policy_objects(name),
            timeout=60,
        )

        def refused() -> bool:
            pod, refusal = running.create(pod_manifest("late", name), ns)
            return pod is None and f"network '{name}'" in refusal and "does not exist" in refusal

        # The apiserver drops the deleted policy from its in-process set within moments.
        wait_for("pods naming the deleted network to be refused", refused, timeout=30)
    finally:
        env.start_replica()


def test_network_being_deleted_while_the_operator_is_stopped_injects_nothing(
    running: ModeEnv,
) -> None:
    """A cleanupOnDelete network, which the operator holds with its cleanup finalizer,
    deleted while the operator is down, waits for it (Terminating); the garbage collector
    keeps its policy until then, but the policy reads the network's deletionTimestamp
    (its binding's param) and injects nothing: pods naming it are refused."""
    env = running.env
    name = f"held-{env.tag}"
    env.create_network(name, healthy=0, cleanupOnDelete=True)
    env.wait_cached(name)
    if env.mode == "webhook":
        # Never both; and the pod webhook fails closed while it is down (above).
        assert env.pod_policy_objects(name) == []
        running.cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--wait=false")
        return
    kubectl = running.cluster.kubectl
    finalizer = json.dumps({"metadata": {"finalizers": [c.CLEANUP_FINALIZER]}})
    kubectl("patch", c.NETWORK_PLURAL, name, "--type=merge", "-p", finalizer)
    ns = running.namespaces[None]
    env.stop_replica()
    try:
        kubectl("delete", c.NETWORK_PLURAL, name, "--wait=false")

        def refused() -> bool:
            pod, refusal = running.create(pod_manifest("late", name), ns)
            return pod is None and f"network '{name}'" in refusal and "does not exist" in refusal

        wait_for("pods naming the network being deleted to be refused", refused, timeout=30)
        assert env.pod_policy_objects(name) == [
            "mutatingadmissionpolicy",
            "mutatingadmissionpolicybinding",
        ]
        # The operator's work done: the finalizer goes, and the policy with the network.
        kubectl(
            "patch", c.NETWORK_PLURAL, name, "--type=merge", "-p", '{"metadata":{"finalizers":[]}}'
        )
        wait_for(
            "the garbage collector to delete the policy",
            lambda: not env.pod_policy_objects(name),
            timeout=60,
        )
    finally:
        kubectl(
            "patch",
            c.NETWORK_PLURAL,
            name,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":[]}}',
            check=False,
        )
        env.start_replica()


POD_NETWORK_PODS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "plain": ({}, {}),
    "comma": ({MULTUS: " sriov-a@net1 , other/b "}, {}),
    "json": ({MULTUS: '[ {"name": "sriov-a", "interface": "net1"} ]'}, {}),
    "json-empty": ({MULTUS: "[]"}, {}),
    "listed": ({MULTUS: "metaroce-system/{mr}@data0"}, {}),
    "host-network": ({}, {"hostNetwork": True}),
    "user-iface": ({}, {"env": [{"name": "FI_METAROCE_IFACE", "value": "eth0"}]}),
    "two-containers": ({MULTUS: "a"}, {"sidecar": True}),
}


@pytest.mark.parametrize("variant", list(POD_NETWORK_PODS))
def test_pod_network_attachment_matches_the_webhook_s_pure_mutation(
    running: ModeEnv, variant: str
) -> None:
    """Issue 14: a metaroce network with podNetwork macvlan. The pod the apiserver stores
    (pod webhook, or the network's MutatingAdmissionPolicy) has the Multus annotation and
    the interface variables the webhook's pure `mutate_pod` gives: the policy's CEL does
    the same string surgery on both of Multus's annotation forms, and leaves hostNetwork
    pods on the node's netdev."""
    import jsonpatch  # type: ignore[import-untyped]

    from metaroce_api import validate_network
    from metaroce_api.podnet import nad_name
    from metaroce_operator.webhooks.mutate import (
        PSS_ENFORCE,
        Allowed,
        Namespace,
        NetworkView,
        mutate_pod,
    )

    mr = mr_name(running.env.tag)
    annotations, extra = POD_NETWORK_PODS[variant]
    pod = pod_manifest(f"pn-{variant}", mr)
    pod["metadata"]["annotations"].update(
        {k: v.replace("{mr}", nad_name(mr)) for k, v in annotations.items()}
    )
    if extra.get("hostNetwork"):
        pod["spec"]["hostNetwork"] = True
    if "env" in extra:
        pod["spec"]["containers"][0]["env"] = extra["env"]
    if extra.get("sidecar"):
        pod["spec"]["containers"].append(
            {
                "name": "sidecar",
                "image": "registry.invalid/log:1",
                "env": [{"name": "X", "value": "1"}],
            }
        )
    ns = running.namespaces["privileged"]
    live = json.loads(running.cluster.kubectl("get", c.NETWORK_PLURAL, mr, "-o", "json").stdout)
    decision = mutate_pod(
        pod,
        {mr: NetworkView(mr, validate_network(live))},
        Namespace(ns, {PSS_ENFORCE: "privileged"}),
    )
    assert isinstance(decision, Allowed), decision
    expected = jsonpatch.apply_patch(pod, decision.patch)
    stored, refusal = running.create(pod, ns)
    assert stored is not None, refusal
    assert stored["metadata"]["annotations"].get(MULTUS) == expected["metadata"]["annotations"].get(
        MULTUS
    )
    assert _what_admission_sets(stored) == _what_admission_sets(expected)
    env = _what_admission_sets(stored)[0]["env"]
    if variant == "host-network":
        assert MULTUS not in stored["metadata"]["annotations"] and "FI_METAROCE_IFACE" not in env
    elif variant == "user-iface":
        assert env["FI_METAROCE_IFACE"] == "eth0" and env["MR_NCCL_IFNAME"] == "=mr0"
    else:
        assert env["FI_METAROCE_IFACE"] == "mr0", env
        assert nad_name(mr) in stored["metadata"]["annotations"][MULTUS]
