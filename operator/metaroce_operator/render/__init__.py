"""Rendering of a network's children: pure functions from (network, settings) to objects.

One module per child kind (configmap, rbac, daemonset, and `nad`: the Multus
NetworkAttachmentDefinition of a network whose pods get a secondary interface) over
jinja2 templates in `templates/`, and in `policy` admission mode the pod admission policy
(`podpolicy`, built in code: its CEL is generated); `render_network` returns them in
apply order.
"""

from __future__ import annotations

from typing import Any

from metaroce_api import MetaRoceNetwork
from metaroce_operator.render.common import RenderContext, child_labels, child_name
from metaroce_operator.render.configmap import config_generation, render_configmap
from metaroce_operator.render.daemonset import render_daemonset
from metaroce_operator.render.nad import render_nad, wants_nad
from metaroce_operator.render.podpolicy import render_pod_policy
from metaroce_operator.render.rbac import render_rbac
from metaroce_operator.settings import RenderSettings

__all__ = [
    "RenderContext",
    "child_labels",
    "child_name",
    "config_generation",
    "render_network",
]


def render_network(
    network: MetaRoceNetwork,
    settings: RenderSettings,
    *,
    config_generation: int | None = None,
    anchor_uid: str | None = None,
    namespace_uid: str | None = None,
    nodes_holding: bool = False,
) -> list[dict[str, Any]]:
    """The children of `network`, in apply order: ClusterRole, ServiceAccount,
    ClusterRoleBinding, ConfigMap, the NetworkAttachmentDefinition (podNetwork macvlan or
    ipvlan), DaemonSet, and in `policy` admission mode the
    MutatingAdmissionPolicy and its binding (always owned by the network itself, so they
    go with it even before its agents have reverted the nodes). The ClusterRole first: with
    `cleanupOnDelete` it owns the others, see `common.anchor_references`, whose
    `anchor_uid` is its uid, and `namespace_uid` that of the agents' namespace, which
    owns it; the DaemonSet after the agents' RBAC and config, so its pods find them).
    With the chart's shared agents' ClusterRole there is none, and the ClusterRoleBinding
    comes first, as the anchor: ClusterRoleBinding, ServiceAccount, ConfigMap, DaemonSet.
    `config_generation`: see `render.configmap.config_generation`; `nodes_holding`: a node
    holds off agent updates (upgrade.py), so the DaemonSet is `OnDelete`."""
    ctx = RenderContext.build(
        network, settings, config_generation, anchor_uid, namespace_uid, nodes_holding
    )
    rbac = render_rbac(ctx)
    attachment = [render_nad(ctx)] if wants_nad(network) else []
    if len(rbac) == 2:
        account, binding = rbac
        children = [binding, account, render_configmap(ctx), *attachment, render_daemonset(ctx)]
    else:
        account, role, binding = rbac
        children = [
            role, account, binding, render_configmap(ctx), *attachment, render_daemonset(ctx)
        ]  # fmt: skip
    if settings.admission_mode == "policy":
        children += render_pod_policy(network, settings)
    return children
