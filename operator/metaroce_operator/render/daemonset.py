"""The node-agent DaemonSet."""

from __future__ import annotations

from typing import Any

from metaroce_api import MetaRoceNetwork
from metaroce_api import constants as c
from metaroce_api.podnet import MULTUS_CONF_DIR
from metaroce_operator.render.common import (
    CONFIG_DIR,
    CONFIG_FILE,
    RenderContext,
    render_template,
)
from metaroce_operator.render.nad import wants_nad


def node_placement(network: MetaRoceNetwork) -> tuple[dict[str, str], dict[str, Any] | None]:
    """(nodeSelector, affinity): the network's label selector OR the network's
    operator-managed node label (`constants.node_label`, see nodelabels.py).

    The selector places agents as soon as a node matches (nothing waits for the
    operator); the label keeps an agent on a node that left the selector until it has
    reverted the node. The two are ORed node affinity terms (matchLabels become In
    expressions); a network selecting every node needs neither.
    """
    selector = network.spec.node_selector
    node_selector = {"kubernetes.io/os": "linux"}
    selected = [
        {"key": k, "operator": "In", "values": [v]}
        for k, v in sorted((selector.match_labels or {}).items())
    ]
    selected += [
        {k: v for k, v in e.to_api().items() if k in ("key", "operator", "values")}
        for e in selector.match_expressions or []
    ]
    if not selected:
        return node_selector, None
    labelled = [{"key": c.node_label(network.name), "operator": "Exists"}]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": selected},
                                      {"matchExpressions": labelled}]
            }
        }
    }  # fmt: skip
    return node_selector, affinity


def tolerations(
    network: MetaRoceNetwork, cluster_defaults: tuple[dict[str, Any], ...] = ()
) -> list[dict[str, Any]]:
    """The spec's tolerations, the chart's cluster-wide ones (agent.tolerations), plus the
    network's own taint, so an agent stays on a node the operator tainted (it must keep
    reporting, or the node could never recover)."""
    own = {"key": c.UNHEALTHY_TAINT_KEY, "operator": "Exists", "effect": c.UNHEALTHY_TAINT_EFFECT}
    out: list[dict[str, Any]] = []
    for toleration in [*(t.to_api() for t in network.spec.tolerations or []),
                       *cluster_defaults, own]:  # fmt: skip
        if toleration not in out:
            out.append(toleration)
    return out


MIN_READY_SECONDS = 15
"""How long an agent must be ready (verified) before the rollout moves on (#15)."""


def render_daemonset(ctx: RenderContext) -> dict[str, Any]:
    spec = ctx.network.spec
    node_selector, affinity = node_placement(ctx.network)
    resources = spec.agent.resources
    settings = ctx.settings
    values = ctx.values()
    return render_template(
        "agent/daemonset.yaml.j2",
        **values,
        selector=ctx.selector,
        max_unavailable=spec.agent.update_strategy.max_unavailable,
        # Paused, or a node holds off updates (the operator replaces the others' agents,
        # upgrade.py): the DaemonSet controller replaces none.
        on_delete=spec.agent.update_strategy.paused or ctx.nodes_holding,
        min_ready_seconds=MIN_READY_SECONDS,
        # The chart's pod labels and annotations first: the operator's own keys win (the
        # selector, the config hash that rolls the agents, the metrics port).
        pod_labels={**dict(settings.agent_pod_labels), **values["labels"]},
        pod_annotations={
            **dict(settings.agent_pod_annotations),
            c.CONFIG_HASH_ANNOTATION: ctx.config_hash,
            c.METRICS_PORT_ANNOTATION: str(spec.agent.metrics_port),
        },
        node_selector=node_selector,
        affinity=affinity,
        tolerations=tolerations(ctx.network, settings.agent_tolerations),
        priority_class=settings.agent_priority_class,
        image=spec.agent.image or settings.agent_image,
        image_pull_policy=settings.agent_image_pull_policy,
        pull_secrets=[{"name": name} for name in settings.agent_image_pull_secrets],
        kubelet_root_dir=settings.kubelet_root_dir,
        config_dir=CONFIG_DIR,
        config_file=CONFIG_FILE,
        config_path=f"{CONFIG_DIR}/{CONFIG_FILE}",
        config_key=c.AGENT_CONFIG_KEY,
        metrics_port=spec.agent.metrics_port,
        probe_port=spec.agent.probe_port,
        multus_conf_dir=MULTUS_CONF_DIR if wants_nad(ctx.network) else "",
        resources={
            k: v for k, v in (("requests", resources.requests), ("limits", resources.limits)) if v
        },
    )
