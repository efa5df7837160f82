"""Every name the parts of MetaRoCE share: API coordinates, annotations, labels, finalizers.

Kept in one module so that the operator, the agent, the webhook and the chart cannot drift
apart on a spelling.
"""

import hashlib
from typing import Final

# --- API coordinates ---------------------------------------------------------------
GROUP: Final = "metaroce.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "metaroce.io/v1alpha1"
CATEGORY: Final = "metaroce"
"""`kubectl get metaroce` lists both kinds."""

NETWORK_KIND: Final = "MetaRoceNetwork"
NETWORK_LIST_KIND: Final = "MetaRoceNetworkList"
NETWORK_PLURAL: Final = "metarocenetworks"
NETWORK_SINGULAR: Final = "metarocenetwork"
NETWORK_SHORT_NAMES: Final = ("mrn",)
NETWORK_CRD_NAME: Final = "metarocenetworks.metaroce.io"

NODESTATE_KIND: Final = "MetaRoceNodeState"
NODESTATE_LIST_KIND: Final = "MetaRoceNodeStateList"
NODESTATE_PLURAL: Final = "metarocenodestates"
NODESTATE_SINGULAR: Final = "metarocenodestate"
NODESTATE_SHORT_NAMES: Final = ("mrns",)
NODESTATE_CRD_NAME: Final = "metarocenodestates.metaroce.io"

# --- annotations ---------------------------------------------------------------------
NETWORKS_ANNOTATION: Final = f"{GROUP}/networks"
"""On a Pod: `<name>[,<name>...]`, the networks the pod asks for (the webhook's trigger)."""
INJECTED_ANNOTATION: Final = f"{GROUP}/injected"
"""On a Pod: what the webhook injected (JSON), so a reader need not diff the pod spec."""
POLICY_INJECTED_PREFIX: Final = f"injected.{GROUP}"
"""On a Pod admitted by the admission policies (`policy` mode): the annotation
`injected.metaroce.io/<network>` records what that network's policy injected (JSON), one
per network, since each network's policy runs on its own."""
CONFIG_HASH_ANNOTATION: Final = f"{GROUP}/config-hash"
"""On the agent pod template: hash of the rendered agent config, so a change rolls the agents."""

# --- labels ----------------------------------------------------------------------------
NETWORK_LABEL: Final = f"{GROUP}/network"
"""On every child object and NodeState: the network it belongs to."""
NODE_LABEL: Final = f"{GROUP}/node"
"""On a NodeState: the node it reports on."""
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
NAME_LABEL: Final = "app.kubernetes.io/name"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"
PART_OF_LABEL: Final = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
APP_NAME: Final = "metaroce"
MANAGED_BY: Final = "metaroce-operator"
COMPONENT_AGENT: Final = "node-agent"
COMPONENT_OPERATOR: Final = "operator"

# --- finalizers, field managers, taints -------------------------------------------------
CLEANUP_FINALIZER: Final = f"{GROUP}/cleanup"
"""Held on a network with `cleanupOnDelete: true` until every agent has reverted its node."""
FIELD_MANAGER: Final = "metaroce-operator"
"""The one server-side-apply field manager of the operator."""
AGENT_FIELD_MANAGER: Final = "metaroce-agent"
UNHEALTHY_TAINT_KEY: Final = f"{GROUP}/rdma-unhealthy"
"""NoSchedule taint put on nodes whose RDMA probe fails (health.action: taint)."""
UNHEALTHY_TAINT_EFFECT: Final = "NoSchedule"
NODE_LABEL_PREFIX: Final = f"{GROUP}/agent-"
"""The operator-managed node label of a network (`node_label`): the only Node labels the
operator writes (its admission policy allows no others)."""
NODE_SELECTED: Final = "selected"
NODE_REVERT: Final = "revert"
"""Values of a network's node label: the node is the network's, or it left the network's
nodeSelector and its agent must revert it first (cleanupOnDelete)."""


UPDATE_HOLD_LABEL: Final = f"{GROUP}/hold-agent-update"
"""A node opts out of agent updates while a job runs: the value is the hold's deadline in
UTC, ISO 8601 basic format (`20261201T200000Z`), at most the network's
`spec.agent.updateStrategy.maxHold` ahead (the operator's upgrade.py). Not under
NODE_LABEL_PREFIX: the operator never writes it."""
UPDATE_HOLD_FORMAT: Final = "%Y%m%dT%H%M%SZ"


def node_label(network: str) -> str:
    """`metaroce.io/agent-<network>`, the name part cut to 63 characters with a hash."""
    name = "agent-" + network
    if len(name) > 63:
        name = f"{name[:52].rstrip('.-_')}-{hashlib.sha256(network.encode()).hexdigest()[:10]}"
    return f"{GROUP}/{name}"


# --- resource and object names ----------------------------------------------------------
RESOURCE_NAME_TEMPLATE: Final = GROUP + "/{network}"
"""Default extended resource of a network: `metaroce.io/<network>`."""
AGENT_CONFIG_KEY: Final = "agent-config.yaml"
"""Key of the rendered agent config in the per-network ConfigMap."""
MAX_NETWORK_NAME_LENGTH: Final = 63
"""A network name is used in label values and resource names, both limited to 63."""
MAX_OBJECT_NAME_LENGTH: Final = 253

# --- conditions --------------------------------------------------------------------------
CONDITION_READY: Final = "Ready"
CONDITION_PROGRESSING: Final = "Progressing"
CONDITION_DEGRADED: Final = "Degraded"
CONDITION_TYPES: Final = (CONDITION_READY, CONDITION_PROGRESSING, CONDITION_DEGRADED)

# Reasons (CamelCase, as metav1.Condition requires).
REASON_RECONCILED: Final = "Reconciled"
REASON_ROLLING_OUT: Final = "RollingOut"
REASON_WAITING_FOR_NODES: Final = "WaitingForNodes"
REASON_NO_MATCHING_NODES: Final = "NoMatchingNodes"
REASON_NODES_FAILED: Final = "NodesFailed"
REASON_NODES_UNHEALTHY: Final = "NodesUnhealthy"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_NIC_CONFLICT: Final = "NicConflict"
REASON_RENDER_FAILED: Final = "RenderFailed"
REASON_AGENT_IMAGE_NOT_ALLOWED: Final = "AgentImageNotAllowed"
REASON_CLEANING_UP: Final = "CleaningUp"
REASON_AS_EXPECTED: Final = "AsExpected"
REASON_MULTUS_MISSING: Final = "MultusNotInstalled"
"""podNetwork macvlan/ipvlan, and Multus's NetworkAttachmentDefinition CRD is not served."""
REASON_POD_SUBNET_TOO_SMALL: Final = "PodSubnetTooSmall"

# --- pod attachment: webhooks and device plugin ---------------------------------------------
CONTAINER_ANNOTATION: Final = f"{GROUP}/container"
"""On a Pod: which container NCCL runs in (the one the webhook injects into; default the
first)."""
PROBE_ENDPOINT_ANNOTATION: Final = f"{GROUP}/probe-endpoint"
"""On a NodeState: `<ip>:<port>` of the agent's RDMA probe side channel, for peer agents."""
METRICS_PORT_ANNOTATION: Final = f"{GROUP}/metrics-port"
"""On an agent Pod: the host port of its /metrics (`spec.agent.metricsPort`); the chart's
PodMonitor scrapes it. Not a declared containerPort: with the host network that would be
a hostPort, and the scheduler would then refuse a second network's agent on the node."""
WEBHOOK_MUTATE_PATH: Final = "/mutate-pod"
"""Path of the pod mutating webhook (the chart's `pods.metaroce.io` clientConfig)."""
WEBHOOK_VALIDATE_PATH: Final = "/validate-network"
"""Path of the network validating webhook (the chart's `networks.metaroce.io`)."""
POD_WEBHOOK_NAME: Final = f"pods.{GROUP}"
NETWORK_WEBHOOK_NAME: Final = f"networks.{GROUP}"
WEBHOOK_CERT_SECRET_TEMPLATE: Final = "{fullname}-webhook-tls"
"""The chart's `metaroce.certSecret`: the Secret holding the webhook's CA and certificate."""
WEBHOOK_SERVICE_TEMPLATE: Final = "{fullname}-webhook"
"""The chart's `metaroce.webhookService`."""
POD_WEBHOOK_CONFIG_TEMPLATE: Final = "{fullname}-pods"
"""The chart's MutatingWebhookConfiguration name."""
NETWORK_WEBHOOK_CONFIG_TEMPLATE: Final = "{fullname}-networks"
"""The chart's ValidatingWebhookConfiguration name."""
DEVICE_PLUGIN_SOCKET_PREFIX: Final = "metaroce-"
"""Our sockets in the kubelet's device-plugin directory: `metaroce-<resource>.sock`."""
REASON_CLEANUP_TIMED_OUT: Final = "CleanupTimedOut"
"""Degraded: a deleted network's agents did not all report `reverted` in time."""
REASON_LOSSY_ON_GO_BACK_N: Final = "LossyProfileOnGoBackN"
"""Degraded: qos.profile lossy with a go-back-N transport (rocev2, softroce)."""

# --- the node agent ----------------------------------------------------------------------
AGENT_METRICS_PORT: Final = 9478
"""The agent's Prometheus endpoint (host network)."""
AGENT_PROBE_PORT: Final = 47911
"""The agent's RDMA probe side channel (TCP, host network)."""

# NodeState Ready condition reasons (CamelCase, as metav1.Condition requires).
NODESTATE_REASON_APPLIED: Final = "Applied"
NODESTATE_REASON_DEGRADED: Final = "Degraded"
NODESTATE_REASON_APPLY_FAILED: Final = "ApplyFailed"
NODESTATE_REASON_PLAN_BLOCKED: Final = "PlanBlocked"
NODESTATE_REASON_REVERTED: Final = "Reverted"
NODESTATE_REASON_PENDING: Final = "Pending"
NODESTATE_REASON_ROLLBACK_INCOMPLETE: Final = "RollbackIncomplete"
"""Degraded: a failed re-apply could not restore every knob to its last verified value;
the agent retries with backoff. Not configured: the node runs neither config."""
NODESTATE_REASON_REVERT_INCOMPLETE: Final = "RevertIncomplete"
"""Degraded: a revert (cleanupOnDelete) left knobs applied; the agent retries it."""
NODESTATE_INCOMPLETE_REASONS: Final = frozenset(
    {NODESTATE_REASON_ROLLBACK_INCOMPLETE, NODESTATE_REASON_REVERT_INCOMPLETE}
)
"""Ready-condition reasons of a node whose settings are half-way between two states: the
operator counts it failed, never configured, whatever its phase."""
NODESTATE_ERROR_STEP_RETRY: Final = "retry"
"""`step` of the NodeState error that says when a failed pass is tried again (it comes
after the failure itself); the operator names a failing node by the errors before it."""
DEVICE_PLUGIN_DIR: Final = "/var/lib/kubelet/device-plugins"
"""The kubelet's device-plugin directory (its registration socket `kubelet.sock` and ours);
the agent DaemonSet mounts it from the host."""
