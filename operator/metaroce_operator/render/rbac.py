"""The agent's ServiceAccount, ClusterRole and ClusterRoleBinding (least privilege)."""

from __future__ import annotations

from typing import Any

from metaroce_api import constants as c
from metaroce_operator.render.common import RenderContext, render_template


def render_rbac(ctx: RenderContext) -> list[dict[str, Any]]:
    values = ctx.values()
    return [
        render_template("agent/serviceaccount.yaml.j2", **values),
        render_template(
            "agent/clusterrole.yaml.j2",
            **{**values, "owner_refs": ctx.anchor_owner_refs},
            group=c.GROUP,
            nodestates=c.NODESTATE_PLURAL,
            networks=c.NETWORK_PLURAL,
        ),
        render_template("agent/clusterrolebinding.yaml.j2", **values),
    ]
