"""The agent image allowlist: which images a network may run on the nodes.

An agent runs privileged, with the host's PID and network namespaces and read-write
/dev and /sys: the image a network names in `spec.agent.image` is code run as root on
every node it selects. So the operator runs only images it was given: its default
(`--agent-image`, the chart's pinned image) and `--allowed-agent-image` (the chart's
`agent.allowedImages`), compared as exact references. The webhook refuses other images
when a network is written; the operator refuses them again before rendering (an object
admitted while the webhook was off, or under an older allowlist).
"""

from __future__ import annotations

from collections.abc import Sequence

from metaroce_api import MetaRoceNetwork


def image_refusal(network: MetaRoceNetwork, allowed: Sequence[str]) -> str | None:
    """Why `spec.agent.image` may not run, or None (unset means the default image)."""
    image = network.spec.agent.image
    if not image or image in allowed:
        return None
    return (
        f"agent image {image!r} is not on this operator's allowlist "
        f"({', '.join(allowed)}): agents run privileged on the nodes, so only these run. "
        "Remove spec.agent.image to use the default, or have the cluster admin add the image "
        "(by digest where possible) to the chart's agent.allowedImages "
        "(operator flag --allowed-agent-image)"
    )
