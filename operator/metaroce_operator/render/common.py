"""What every child renderer shares: names, labels, owner references, the config hash and
the jinja2 environment.

Rendering is deterministic (sorted keys, no timestamps, no randomness): a restarted
operator renders byte-identical objects, so server-side apply is a no-op and nothing rolls.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import jinja2
import yaml

from metaroce_api import AgentConfig, MetaRoceNetwork
from metaroce_api import constants as c
from metaroce_operator.settings import RenderSettings

AGENT_PREFIX = "metaroce-agent-"
MAX_NAME = 63
CONFIG_DIR = "/etc/metaroce"
CONFIG_FILE = "agent.yaml"
"""The agent reads `/etc/metaroce/agent.yaml` (the ConfigMap key mapped to this file)."""


def fit_name(text: str, limit: int = MAX_NAME) -> str:
    """`text`, or a prefix plus a short hash of it when longer than `limit` (stable, unique)."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{text[: limit - 11].rstrip('.-')}-{digest}"


def child_name(network: str) -> str:
    """Name of every per-network child: `metaroce-agent-<network>`, made to fit 63 chars."""
    return fit_name(AGENT_PREFIX + network)


def selector_labels(network: str) -> dict[str, str]:
    """The DaemonSet's selector (immutable: keep it to what never changes)."""
    return {c.NETWORK_LABEL: network, c.COMPONENT_LABEL: c.COMPONENT_AGENT}


def child_labels(network: str) -> dict[str, str]:
    """Labels of every child object and agent pod."""
    return {
        **selector_labels(network),
        c.NAME_LABEL: AGENT_PREFIX.rstrip("-"),
        c.INSTANCE_LABEL: network,
        c.PART_OF_LABEL: c.APP_NAME,
        c.MANAGED_BY_LABEL: c.MANAGED_BY,
    }


def owner_references(network: MetaRoceNetwork) -> list[dict[str, Any]]:
    """The network as controller owner, so deleting it garbage-collects the children.

    Offline rendering (no uid yet) gets none: the objects are for review, and an owner
    reference without a uid is invalid.
    """
    uid = network.metadata.uid
    if not uid:
        return []
    return [
        {
            "apiVersion": c.API_VERSION,
            "kind": c.NETWORK_KIND,
            "name": network.name,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def anchor_kind(settings: RenderSettings) -> str:
    """The cluster-scoped child that anchors a `cleanupOnDelete` network's others: its
    ClusterRole, or its ClusterRoleBinding when the agents share the chart's ClusterRole
    (`RenderSettings.agent_cluster_role`)."""
    return "ClusterRole" if settings.agent_cluster_role is None else "ClusterRoleBinding"


def anchor_references(
    network: MetaRoceNetwork, anchor_uid: str, kind: str = "ClusterRole"
) -> list[dict[str, Any]]:
    """For a `cleanupOnDelete` network: the agents' ClusterRole (or ClusterRoleBinding,
    see `anchor_kind`) as owner of the other children, instead of the network.

    Deleting the network must not take the agents (and the RBAC they report with) before
    every node reported its settings reverted. A finalizer on the network holds the
    network, not its dependents: foreground deletion (`--cascade=foreground`, Argo CD's
    prune default) makes the garbage collector delete those first. So these children are
    not the network's dependents: the ClusterRole (cluster-scoped, so it may own both the
    cluster-scoped and the namespaced children) has no owner, and the operator deletes it
    once the nodes reverted; the garbage collector then takes the rest. No
    blockOwnerDeletion: that would need update on clusterroles/finalizers.

    The ClusterRole itself is owned by the agents' namespace (see
    `namespace_references`), so uninstalling the chart (which deletes the namespace)
    leaves nothing behind even when a network's finalizer was removed by hand with no
    operator running."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": kind,
            "name": child_name(network.name),
            "uid": anchor_uid,
        }
    ]


def namespace_references(namespace: str, namespace_uid: str | None) -> list[dict[str, Any]]:
    """The agents' namespace as owner of a cleanupOnDelete network's ClusterRole."""
    if not namespace_uid:
        return []
    return [{"apiVersion": "v1", "kind": "Namespace", "name": namespace, "uid": namespace_uid}]


def agent_config(network: MetaRoceNetwork, config_generation: int | None = None) -> AgentConfig:
    """The agent's config; `config_generation` is the generation it was first rendered at."""
    config = AgentConfig.from_network(network)
    if config_generation is not None:
        config = config.model_copy(update={"generation": config_generation})
    return config


def config_hash(config: AgentConfig) -> str:
    """Hash of the agent config WITHOUT its generation: only content changes roll agents."""
    text = config.model_copy(update={"generation": 0}).to_yaml()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def to_json(value: Any) -> str:
    """jinja2 filter: a value as JSON (valid YAML), keys sorted, no HTML escaping."""
    return json.dumps(value, sort_keys=True)


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("metaroce_operator.render", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["json"] = to_json
    return env


def render_template(path: str, **values: Any) -> dict[str, Any]:
    """Render one template to a dict (the template emits YAML with JSON-quoted values)."""
    text = environment().get_template(path).render(**values)
    obj = yaml.safe_load(text)
    if not isinstance(obj, dict):
        raise ValueError(f"template {path} did not render one object")
    return obj


@dataclass(frozen=True)
class RenderContext:
    """Everything the per-kind renderers read, computed once."""

    network: MetaRoceNetwork
    settings: RenderSettings
    config: AgentConfig
    config_yaml: str
    config_hash: str
    name: str
    namespace: str
    labels: dict[str, str]
    selector: dict[str, str]
    owner_refs: list[dict[str, Any]]
    """Of every child but the anchor (see `anchor_kind`)."""
    anchor_owner_refs: list[dict[str, Any]]
    """Of the anchor: when it is one (see `anchor_references`), its namespace's, not the
    network's."""
    nodes_holding: bool = False
    """A node holds off agent updates (see upgrade.py): the DaemonSet is `OnDelete`."""

    @classmethod
    def build(
        cls,
        network: MetaRoceNetwork,
        settings: RenderSettings,
        config_generation: int | None = None,
        anchor_uid: str | None = None,
        namespace_uid: str | None = None,
        nodes_holding: bool = False,
    ) -> RenderContext:
        config = agent_config(network, config_generation)
        owners = owner_references(network)
        anchor_owners = owners
        if network.spec.cleanup_on_delete:
            kind = anchor_kind(settings)
            owners = anchor_references(network, anchor_uid, kind) if anchor_uid else []
            anchor_owners = namespace_references(settings.namespace, namespace_uid)
        return cls(
            network=network,
            settings=settings,
            config=config,
            config_yaml=config.to_yaml(),
            config_hash=config_hash(config),
            name=child_name(network.name),
            namespace=settings.namespace,
            labels=child_labels(network.name),
            selector=selector_labels(network.name),
            owner_refs=owners,
            anchor_owner_refs=anchor_owners,
            nodes_holding=nodes_holding,
        )

    def values(self) -> dict[str, Any]:
        """The template variables every template gets."""
        return {
            "network": self.network.name,
            "name": self.name,
            "namespace": self.namespace,
            "labels": self.labels,
            "owner_refs": self.owner_refs,
        }
