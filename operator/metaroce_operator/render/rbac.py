"""The agent's ServiceAccount, ClusterRole and ClusterRoleBinding (least privilege).

With the chart's shared agents' ClusterRole (`RenderSettings.agent_cluster_role`) no
ClusterRole is rendered: the binding names the shared one."""

from __future__ import annotations

from typing import Any

from metaroce_api import constants as c
from metaroce_operator.render.common import RenderContext, render_template


def render_rbac(ctx: RenderContext) -> list[dict[str, Any]]:
    """[ServiceAccount, ClusterRole (without a shared one), ClusterRoleBinding]."""
    values = ctx.values()
    shared = ctx.settings.agent_cluster_role
    account = render_template("agent/serviceaccount.yaml.j2", **values)
    if shared is not None:
        binding = render_template(
            "agent/clusterrolebinding.yaml.j2",
            **{**values, "owner_refs": ctx.anchor_owner_refs},
            role=shared,
        )
        return [account, binding]
    role = render_template(
        "agent/clusterrole.yaml.j2",
        **{**values, "owner_refs": ctx.anchor_owner_refs},
        group=c.GROUP,
        nodestates=c.NODESTATE_PLURAL,
        networks=c.NETWORK_PLURAL,
    )
    binding = render_template("agent/clusterrolebinding.yaml.j2", **values, role=values["name"])
    return [account, role, binding]
