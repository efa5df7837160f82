"""The network's NetworkAttachmentDefinition (Multus), for `spec.attachment.podNetwork`
modes macvlan and ipvlan: see `metaroce_api.podnet` for how it works.

Rendered without `spec.config` (Multus then reads the node's own configuration, which
the agent writes); its annotation `metaroce.io/pod-network` says what the nodes' files
hold, for people reading it. Namespaced in the agents' namespace, owned like the other
children, so it goes with the network.
"""

from __future__ import annotations

import json
from typing import Any

from metaroce_api import MetaRoceNetwork
from metaroce_api import constants as c
from metaroce_api.podnet import NAD_API_VERSION, NAD_KIND, nad_name
from metaroce_operator.render.common import RenderContext, render_template

POD_NETWORK_ANNOTATION = f"{c.GROUP}/pod-network"


def wants_nad(network: MetaRoceNetwork) -> bool:
    """Whether the network's pods get a Multus secondary interface."""
    pod_network = network.spec.attachment.pod_network
    return (
        network.spec.transport.mode == "metaroce"
        and pod_network is not None
        and pod_network.secondary
    )


def render_nad(ctx: RenderContext) -> dict[str, Any]:
    pod_network = ctx.network.spec.attachment.pod_network
    assert pod_network is not None
    summary = {
        "mode": pod_network.mode,
        "subnet": pod_network.subnet,
        "nodePrefixLength": pod_network.node_prefix_length,
        "interface": pod_network.interface,
        "config": "per node, written by the agent into Multus's confDir",
    }
    return render_template(
        "multus/networkattachmentdefinition.yaml.j2",
        **ctx.values(),
        api_version=NAD_API_VERSION,
        kind=NAD_KIND,
        nad=nad_name(ctx.network.name),
        annotations={POD_NETWORK_ANNOTATION: json.dumps(summary, sort_keys=True)},
    )
