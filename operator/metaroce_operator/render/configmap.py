"""The per-network ConfigMap: the agent's config, rendered from the spec."""

from __future__ import annotations

from typing import Any

from metaroce_api import AgentConfig
from metaroce_api import constants as c
from metaroce_operator.render.common import RenderContext, render_template


def render_configmap(ctx: RenderContext) -> dict[str, Any]:
    return render_template(
        "agent/configmap.yaml.j2",
        **ctx.values(),
        annotations={c.CONFIG_HASH_ANNOTATION: ctx.config_hash},
        config_key=c.AGENT_CONFIG_KEY,
        config_yaml=ctx.config_yaml,
    )


def stored_config(configmap: dict[str, Any] | None) -> tuple[str, AgentConfig] | None:
    """(hash annotation, parsed config) of an existing ConfigMap, or None if unusable."""
    if not configmap:
        return None
    annotations = (configmap.get("metadata") or {}).get("annotations") or {}
    text = (configmap.get("data") or {}).get(c.AGENT_CONFIG_KEY)
    digest = annotations.get(c.CONFIG_HASH_ANNOTATION)
    if not text or not digest:
        return None
    try:
        return digest, AgentConfig.from_yaml(text)
    except ValueError:
        return None


def config_generation(current_hash: str, generation: int, existing: dict[str, Any] | None) -> int:
    """The generation the agents' config dates from.

    A spec change that leaves the agent config alone (say `health.action`) bumps the
    network's generation but must neither roll the agents nor make them report again: keep
    the generation stored in the existing ConfigMap while its content hash is unchanged.
    """
    stored = stored_config(existing)
    if stored is not None:
        digest, config = stored
        if digest == current_hash and config.generation <= generation:
            return config.generation
    return generation
