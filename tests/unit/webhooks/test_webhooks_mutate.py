"""Pod mutation as a pure function over a table of pods, networks and namespaces."""

from __future__ import annotations

import json
from typing import Any

import pytest
from webhook_testlib import apply_patch, pod, view, views

from metaroce_operator.webhooks.mutate import (
    Allowed,
    Denied,
    Namespace,
    NetworkView,
    mutate_pod,
    parse_networks_annotation,
)

NS = Namespace("jobs", {"kubernetes.io/metadata.name": "jobs"})
NETS = views(
    view("backend"),
    view(
        "frontend",
        attachment={
            "resourceName": "example.com/fe",
            "socketInterface": "eth0",
            "ncclEnv": ["NCCL_IB_HCA", "NCCL_IB_TC", "NCCL_SOCKET_IFNAME"],
        },
        qos={"data": {"dscp": 46}},
    ),
    view("cold", healthy=0),
    view("partial", healthy=1, desired=10),
    NetworkView("broken", None, "spec.qos: unknown field"),
)


def mutated(p: dict[str, Any], nets: dict[str, NetworkView] = NETS, ns: Namespace = NS) -> Any:
    decision = mutate_pod(p, nets, ns)
    assert isinstance(decision, Allowed), decision
    return apply_patch(p, decision.patch), decision


def env_of(p: dict[str, Any], index: int = 0) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in p["spec"]["containers"][index].get("env", [])}


def test_minimal_pod_gets_resource_ipc_lock_env_and_record() -> None:
    out, decision = mutated(pod("backend"))
    main = out["spec"]["containers"][0]
    assert main["resources"] == {
        "requests": {"metaroce.io/backend": "1"},
        "limits": {"metaroce.io/backend": "1"},
    }
    assert main["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert env_of(out) == {
        "NCCL_IB_TC": "104",  # DSCP 26 as the whole ToS byte
        "NCCL_IB_QPS_PER_CONNECTION": "1",
        "NCCL_IB_TIMEOUT": "20",
        "NCCL_IB_RETRY_CNT": "7",
    }
    record = json.loads(out["metadata"]["annotations"]["metaroce.io/injected"])
    assert record == {
        "networks": ["backend"],
        "container": "main",
        "resources": {"metaroce.io/backend": "1"},
        "capabilities": ["IPC_LOCK"],
        "env": env_of(out),
        "devicePluginEnv": ["NCCL_IB_GID_INDEX", "NCCL_IB_HCA"],
    }
    assert decision.warnings == []


def test_mutation_is_idempotent() -> None:
    once, _ = mutated(pod("backend,frontend"))
    decision = mutate_pod(once, NETS, NS)
    assert isinstance(decision, Allowed) and decision.patch == []


def test_user_values_are_never_overwritten() -> None:
    p = pod(
        "backend",
        containers=[
            {
                "name": "main",
                "image": "x",
                "env": [{"name": "NCCL_IB_TIMEOUT", "value": "22"}],
                "resources": {
                    "requests": {"metaroce.io/backend": "2", "cpu": "1"},
                    "limits": {"metaroce.io/backend": "2"},
                },
                "securityContext": {"runAsUser": 1000, "capabilities": {"add": ["NET_RAW"]}},
            }
        ],
    )
    out, decision = mutated(p)
    main = out["spec"]["containers"][0]
    assert main["resources"]["requests"] == {"metaroce.io/backend": "2", "cpu": "1"}
    assert main["securityContext"] == {
        "runAsUser": 1000,
        "capabilities": {"add": ["NET_RAW", "IPC_LOCK"]},
    }
    assert env_of(out)["NCCL_IB_TIMEOUT"] == "22"
    assert decision.injected["keptUserEnv"] == ["NCCL_IB_TIMEOUT"]
    assert "resources" not in decision.injected


def test_request_without_limit_gets_the_required_equal_limit() -> None:
    p = pod(containers=[{"name": "m", "resources": {"requests": {"metaroce.io/backend": "2"}}}])
    out, _ = mutated(p)
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"metaroce.io/backend": "2"}


def test_the_container_that_holds_the_resource_gets_ipc_lock_and_the_nccl_env() -> None:
    # A sidecar put first (service meshes prepend theirs): the training container asks for
    # the device, so it, not containers[0], needs IPC_LOCK and the NCCL settings.
    p = pod(
        containers=[
            {"name": "sidecar"},
            {"name": "main", "resources": {"limits": {"metaroce.io/backend": "1"}}},
        ]
    )
    out, decision = mutated(p)
    sidecar, main = out["spec"]["containers"]
    assert sidecar == {"name": "sidecar"}, "nothing may be injected into the sidecar"
    assert main["resources"] == {"limits": {"metaroce.io/backend": "1"}}
    assert main["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert env_of(out, 1)["NCCL_IB_TC"] == "104"
    assert decision.injected["container"] == "main"


def test_an_init_container_that_holds_the_resource_is_considered() -> None:
    p = pod(
        containers=[{"name": "main"}],
        annotations={},
    )
    p["spec"]["initContainers"] = [
        {
            "name": "warmup",
            "restartPolicy": "Always",
            "resources": {"requests": {"metaroce.io/backend": "1"}},
        }
    ]
    out, decision = mutated(p)
    init = out["spec"]["initContainers"][0]
    assert init["resources"]["limits"] == {"metaroce.io/backend": "1"}
    assert init["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert {e["name"] for e in init["env"]} >= {"NCCL_IB_TC", "NCCL_IB_TIMEOUT"}
    # No second device for the main container: the pod asked for one already.
    assert out["spec"]["containers"][0] == {"name": "main"}
    assert decision.injected["container"] == "warmup"


def test_each_network_s_settings_go_to_the_container_holding_its_resource() -> None:
    p = pod(
        "backend,frontend",
        containers=[
            {"name": "a", "resources": {"limits": {"example.com/fe": "1"}}},
            {"name": "b", "resources": {"limits": {"metaroce.io/backend": "1"}}},
        ],
    )
    out, _ = mutated(p)
    assert env_of(out, 0)["NCCL_IB_TC"] == str(46 << 2)  # frontend's DSCP
    assert env_of(out, 1)["NCCL_IB_TC"] == "104"  # backend's
    for c in out["spec"]["containers"]:
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}


def test_the_named_container_can_be_an_init_container() -> None:
    p = pod(annotations={"metaroce.io/container": "setup"}, containers=[{"name": "main"}])
    p["spec"]["initContainers"] = [{"name": "setup", "restartPolicy": "Always"}]
    out, _ = mutated(p)
    assert out["spec"]["initContainers"][0]["resources"]["limits"] == {"metaroce.io/backend": "1"}
    assert out["spec"]["containers"][0] == {"name": "main"}


def test_container_annotation_picks_the_container() -> None:
    p = pod(
        annotations={"metaroce.io/container": "trainer"},
        containers=[{"name": "proxy"}, {"name": "trainer"}],
    )
    out, decision = mutated(p)
    assert "resources" not in out["spec"]["containers"][0]
    assert out["spec"]["containers"][1]["resources"]["limits"] == {"metaroce.io/backend": "1"}
    assert decision.injected["container"] == "trainer"


def test_two_networks_first_one_wins_and_warns() -> None:
    out, decision = mutated(pod("backend, frontend ,backend"))
    main = out["spec"]["containers"][0]
    assert main["resources"]["limits"] == {"metaroce.io/backend": "1", "example.com/fe": "1"}
    env = env_of(out)
    assert env["NCCL_IB_TC"] == "104"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert any(
        "NCCL_IB_TC" in w and "'backend' (listed first) wins" in w for w in decision.warnings
    )
    assert any("NCCL_IB_HCA" in w for w in decision.warnings)
    assert decision.injected["networks"] == ["backend", "frontend"]


def test_pinned_gid_index_is_injected() -> None:
    nets = views(view("backend", transport={"roce": {"gidIndex": 3}}))
    out, decision = mutated(pod(), nets)
    assert env_of(out)["NCCL_IB_GID_INDEX"] == "3"
    assert decision.injected["devicePluginEnv"] == ["NCCL_IB_HCA"]


def test_partly_ready_network_does_not_block() -> None:
    mutated(pod("partial"))


def test_node_health_is_not_admission_s_business() -> None:
    # Every agent-config rollout drops the healthy count to 0 until the agents report
    # again; the scheduler (advertised resources, taints) keeps pods off bad nodes, so a
    # pod for an existing network with no healthy node right now is still admitted.
    out, _ = mutated(pod("cold"))
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"metaroce.io/cold": "1"}
    never_reported = views(view("fresh", healthy=None))
    mutated(pod("fresh"), never_reported)


def test_existing_annotations_and_envfrom() -> None:
    p = pod(
        annotations={"team": "ml"},
        containers=[{"name": "m", "envFrom": [{"configMapRef": {"name": "c"}}]}],
    )
    out, decision = mutated(p)
    assert out["metadata"]["annotations"]["team"] == "ml"
    assert any("envFrom" in w for w in decision.warnings)


def test_dropped_ipc_lock_is_respected_with_a_warning() -> None:
    p = pod(containers=[{"name": "m", "securityContext": {"capabilities": {"drop": ["IPC_LOCK"]}}}])
    out, decision = mutated(p)
    assert out["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["IPC_LOCK"]}
    assert any("drops IPC_LOCK" in w for w in decision.warnings)


def test_unannotated_pod_is_untouched() -> None:
    decision = mutate_pod(pod(None), NETS, NS)
    assert decision == Allowed()


@pytest.mark.parametrize(
    ("networks", "ns", "extra", "expected"),
    [
        (
            "nosuch",
            NS,
            {},
            [
                "network 'nosuch'",
                "does not exist",
                "backend, frontend, partial (ready)",
                "cold (no ready node)",
            ],
        ),
        ("broken", NS, {}, ["network 'broken' cannot be read", "unknown field"]),
        ("Back_end", NS, {}, ["'Back_end' is not a network name", "metaroce.io/networks: backend"]),
        (" , ", NS, {}, ["names no network"]),
        (
            "backend",
            Namespace("jobs", {"pod-security.kubernetes.io/enforce": "baseline"}),
            {},
            ["enforces the Pod Security level 'baseline'", "IPC_LOCK", "enforce=privileged"],
        ),
        (
            "backend",
            Namespace("jobs", {"pod-security.kubernetes.io/enforce": "restricted"}),
            {},
            ["'restricted'"],
        ),
        (
            "backend",
            NS,
            {"metaroce.io/container": "nope"},
            ["container 'nope'", "its containers are 'main'"],
        ),
    ],
)
def test_refusals_name_the_problem_and_the_fix(
    networks: str, ns: Namespace, extra: dict[str, str], expected: list[str]
) -> None:
    decision = mutate_pod(pod(networks, annotations=extra), NETS, ns)
    assert isinstance(decision, Denied), decision
    for text in expected:
        assert text in decision.message
    assert decision.message.startswith("pod jobs/trainer-0: ")


def test_no_networks_at_all_says_create_one() -> None:
    decision = mutate_pod(pod("backend"), {}, NS)
    assert isinstance(decision, Denied)
    assert "no MetaRoceNetwork exists yet" in decision.message


def test_privileged_namespace_and_warn_label() -> None:
    ns = Namespace(
        "jobs",
        {
            "pod-security.kubernetes.io/enforce": "privileged",
            "pod-security.kubernetes.io/warn": "baseline",
        },
    )
    _, decision = mutated(pod(), ns=ns)
    assert any("warn=baseline" in w for w in decision.warnings)


def test_unknown_namespace_labels_skip_the_check() -> None:
    mutated(pod(), ns=Namespace("jobs", None))


def test_pod_security_check_can_be_disabled() -> None:
    ns = Namespace("jobs", {"pod-security.kubernetes.io/enforce": "baseline"})
    decision = mutate_pod(pod(), NETS, ns, check_pod_security=False)
    assert isinstance(decision, Allowed)


def test_generate_name_pods_are_named_in_messages() -> None:
    p = pod("nosuch")
    p["metadata"] = {"generateName": "job-abc-", "annotations": p["metadata"]["annotations"]}
    decision = mutate_pod(p, NETS, NS)
    assert isinstance(decision, Denied) and "pod jobs/job-abc-*" in decision.message


def test_patch_escapes_slashes_and_creates_parents() -> None:
    decision = mutate_pod(pod(), NETS, NS)
    assert isinstance(decision, Allowed)
    paths = [op["path"] for op in decision.patch]
    assert "/spec/containers/0/resources" in paths  # created whole: it was missing
    assert "/metadata/annotations/metaroce.io~1injected" in paths


@pytest.mark.parametrize(
    ("raw", "names"),
    [("a", ["a"]), (" a , b,a,, ", ["a", "b"]), ("net-1,net-2", ["net-1", "net-2"])],
)
def test_annotation_parsing(raw: str, names: list[str]) -> None:
    assert parse_networks_annotation(raw) == (names, None)


def test_cluster_default_pod_security_level_applies_to_unlabelled_namespaces() -> None:
    decision = mutate_pod(pod(), NETS, NS, default_pod_security="baseline")
    assert isinstance(decision, Denied)
    assert "the cluster's default level; the namespace has no label" in decision.message
    labelled = Namespace("jobs", {"pod-security.kubernetes.io/enforce": "privileged"})
    assert isinstance(mutate_pod(pod(), NETS, labelled, default_pod_security="baseline"), Allowed)


def test_the_pod_given_is_never_modified() -> None:
    import copy

    p = pod("backend,frontend", annotations={"x": "y"}, containers=[{"name": "m", "env": []}])
    before = copy.deepcopy(p)
    decision = mutate_pod(p, NETS, NS)
    assert isinstance(decision, Allowed) and decision.patch
    assert p == before


def test_few_patch_operations() -> None:
    decision = mutate_pod(pod("backend"), NETS, NS)
    assert isinstance(decision, Allowed)
    assert [op["path"] for op in decision.patch] == [
        "/spec/containers/0/resources",
        "/spec/containers/0/securityContext",
        "/spec/containers/0/env",
        "/metadata/annotations/metaroce.io~1injected",
    ]
    p = pod(containers=[{"name": "m", "resources": {"requests": {"cpu": "1"}}, "env": []}])
    out, decision = mutated(p)
    assert out["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1", "metaroce.io/backend": "1"},
        "limits": {"metaroce.io/backend": "1"},
    }
    assert len(env_of(out)) == 4


def test_empty_resources_as_the_apiserver_sends_them_take_one_op() -> None:
    # The apiserver defaults `resources: {}`: one op replaces it (fewer ops and bytes for
    # the apiserver to apply), and the result is the same.
    p = pod(containers=[{"name": "main", "image": "x", "resources": {}}])
    out, decision = mutated(p)
    ops = [op for op in decision.patch if "resources" in op["path"]]
    assert ops == [
        {
            "op": "add",
            "path": "/spec/containers/0/resources",
            "value": {
                "requests": {"metaroce.io/backend": "1"},
                "limits": {"metaroce.io/backend": "1"},
            },
        }
    ]
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"metaroce.io/backend": "1"}
    assert p["spec"]["containers"][0]["resources"] == {}  # the input is never modified


LOSSY = view(
    "lossy",
    transport={
        "mode": "metaroce",
        "mtu": 9000,
        "metaroce": {"portRange": {"first": 30000, "last": 30999}, "paths": 8},
    },
    qos={"profile": "lossy", "data": {"dscp": 34, "priority": 4}},
)


def test_metaroce_network_injects_the_transport_settings_not_the_ib_ones() -> None:
    out, decision = mutated(pod("lossy"), views(LOSSY))
    assert env_of(out) == {
        "FI_PROVIDER": "metaroce",
        "NCCL_NET_PLUGIN": "metaroce",
        "MR_CONFIG": (
            "ports=30000-30999,paths=8,mtu=9000,dscp=34,queue_target_us=500,min_rto_us=5000"
        ),
    }
    assert "devicePluginEnv" not in decision.injected
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"metaroce.io/lossy": "1"}
    assert decision.warnings == []


def test_metaroce_user_values_win_and_a_job_taken_off_it_is_reported() -> None:
    p = pod(
        "lossy",
        containers=[
            {
                "name": "main",
                "image": "x",
                "env": [
                    {"name": "MR_CONFIG", "value": "paths=4"},
                    {"name": "NCCL_NET_PLUGIN", "value": "aws-ofi"},
                ],
            }
        ],
    )
    out, decision = mutated(p, views(LOSSY))
    env = env_of(out)
    assert env["MR_CONFIG"] == "paths=4" and env["NCCL_NET_PLUGIN"] == "aws-ofi"
    assert env["FI_PROVIDER"] == "metaroce"
    assert decision.injected["keptUserEnv"] == ["MR_CONFIG", "NCCL_NET_PLUGIN"]
    assert any(
        "NCCL_NET_PLUGIN='aws-ofi'" in w and "will not use the metaroce transport" in w
        for w in decision.warnings
    ), decision.warnings
