"""The chart's shared agents' ClusterRole (issue 16 #13): the operator renders no
ClusterRole, only a binding to the shared one, which anchors cleanupOnDelete children."""

from __future__ import annotations

from operator_testlib import network

from metaroce_operator.render import render_network
from metaroce_operator.settings import RenderSettings

SHARED = RenderSettings(
    namespace="metaroce-system",
    agent_image="example.com/agent:v1",
    agent_cluster_role="rel-metaroce-agent",
)


def test_no_cluster_role_is_rendered_and_the_binding_names_the_shared_one() -> None:
    objs = render_network(network("net"), SHARED)
    assert [o["kind"] for o in objs] == [
        "ClusterRoleBinding",
        "ServiceAccount",
        "ConfigMap",
        "DaemonSet",
    ]
    binding = objs[0]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "rel-metaroce-agent",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "metaroce-agent-net", "namespace": "metaroce-system"}
    ]
    assert binding["metadata"]["name"] == "metaroce-agent-net"


def test_the_binding_anchors_a_cleanup_networks_children() -> None:
    net = network("tidy", cleanupOnDelete=True)
    objs = render_network(net, SHARED, anchor_uid="binding-uid", namespace_uid="ns-uid")
    binding, *rest = objs
    assert binding["kind"] == "ClusterRoleBinding"
    assert binding["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Namespace", "name": "metaroce-system", "uid": "ns-uid"}
    ]
    for obj in rest:
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "name": "metaroce-agent-tidy",
                "uid": "binding-uid",
            }
        ]


def test_the_shared_role_name_is_checked() -> None:
    import pytest

    from metaroce_operator.settings import SettingsError

    with pytest.raises(SettingsError, match="--agent-cluster-role"):
        RenderSettings(agent_cluster_role="Not A Name")
