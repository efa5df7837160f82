"""Operator settings: flags with environment fallbacks, validated with errors that name the
flag, the value and the fix.

Two groups: `RenderSettings` is what rendering a network's children needs (also offline,
for `metaroce render`); `OperatorSettings` adds what the running operator needs.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Final

from metaroce_api import parse_duration
from metaroce_api.common import Toleration
from metaroce_operator import __version__

DEFAULT_NAMESPACE: Final = "metaroce-system"
DEFAULT_AGENT_IMAGE: Final = f"ghcr.io/metaroce/metaroce-agent:{__version__}"
"""Pinned by the operator's own version: an operator renders agents of its release."""
DEFAULT_LEASE_NAME: Final = "metaroce-operator"
ADMISSION_MODES: Final = ("webhook", "policy")
"""How annotated pods are mutated: by the pod webhook of every replica, or by a
MutatingAdmissionPolicy per network that the operator renders (the chart picks)."""
POD_SECURITY_LEVELS: Final = ("privileged", "baseline", "restricted")
DEFAULT_AGENT_PRIORITY_CLASS: Final = "system-node-critical"
DEFAULT_KUBELET_ROOT_DIR: Final = "/var/lib/kubelet"
"""Where the kubelet keeps device-plugins/ and pod-resources/ (k0s: /var/lib/k0s/kubelet,
microk8s: /var/snap/microk8s/common/var/lib/kubelet)."""
PULL_POLICIES: Final = ("Always", "IfNotPresent", "Never")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(:[\w][\w.-]{0,127}|@sha256:[0-9a-f]{64})$")


class SettingsError(ValueError):
    """A flag or environment value is wrong; the message says which and how to fix it."""

    def __init__(self, flag: str, value: object, fix: str) -> None:
        self.flag = flag
        self.value = value
        super().__init__(f"{flag}={value!r}: {fix}")


def check_namespace(flag: str, value: str) -> str:
    if not _DNS_LABEL.match(value):
        raise SettingsError(
            flag, value, "a namespace is a DNS label: lowercase letters, digits and '-', <= 63"
        )
    return value


def check_image(flag: str, value: str) -> str:
    if not _IMAGE.match(value):
        raise SettingsError(
            flag,
            value,
            "give a pinned image reference, e.g. registry.example.com/metaroce-agent:v0.1.0 "
            "or ...@sha256:<digest>",
        )
    if value.endswith(":latest"):
        raise SettingsError(flag, value, "images are pinned by tag, never latest: give a version")
    return value


def parse_seconds(flag: str, value: str | float) -> float:
    """`15`, `2.5`, `15s`, `500ms`, `5m` -> seconds."""
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                seconds = parse_duration(text).total_seconds()
            except ValueError:
                raise SettingsError(
                    flag, value, "write seconds (15, 2.5) or a duration (15s, 500ms, 5m)"
                ) from None
    if seconds < 0:
        raise SettingsError(flag, value, "a duration cannot be negative")
    return seconds


def check_port(flag: str, value: int) -> int:
    if not 0 <= value <= 65535:
        raise SettingsError(flag, value, "give a TCP port 1-65535, or 0 to turn the endpoint off")
    return value


def default_identity() -> str:
    """The pod name in a cluster (downward API `POD_NAME`), else hostname and pid."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class RenderSettings:
    """What rendering needs besides the network: where agents run and which image."""

    namespace: str = DEFAULT_NAMESPACE
    """Namespace of the agents (labelled for the `privileged` Pod Security level)."""
    agent_image: str = DEFAULT_AGENT_IMAGE
    """Image when the network does not set `spec.agent.image`."""
    extra_agent_images: tuple[str, ...] = ()
    """Further images a network may set in `spec.agent.image` (`--allowed-agent-image`)."""
    admission_mode: str = "webhook"
    """`policy`: render each network's MutatingAdmissionPolicy (`--admission-mode`)."""
    pod_security_check: bool = True
    """Policies inject nothing into pods of namespaces whose Pod Security level forbids
    IPC_LOCK (the chart's ValidatingAdmissionPolicy then refuses them with the reason)."""
    pod_security_default: str = "privileged"
    """The cluster's PodSecurity default `enforce` level, for namespaces without the label."""
    agent_cluster_role: str | None = None
    """The agents' ClusterRole the chart ships (`--agent-cluster-role`): each network's
    ClusterRoleBinding names it, and the operator needs `bind` on it only, never write
    access to ClusterRoles. None: a ClusterRole per network (the operator holds the
    agents' rules; for running without the chart)."""

    agent_image_pull_secrets: tuple[str, ...] = ()
    """Secrets in the agents' namespace the agent pods pull with (the chart's
    imagePullSecrets, `--agent-image-pull-secret`)."""
    agent_image_pull_policy: str = "IfNotPresent"
    """imagePullPolicy of the agent container (the chart's agent.image.pullPolicy)."""
    agent_tolerations: tuple[dict[str, Any], ...] = ()
    """Tolerations every agent DaemonSet gets besides its network's (the chart's
    agent.tolerations, `--agent-toleration`), e.g. for the GPU nodes' taints."""
    agent_priority_class: str = DEFAULT_AGENT_PRIORITY_CLASS
    """priorityClassName of the agent pods; empty = none (`--agent-priority-class`)."""
    kubelet_root_dir: str = DEFAULT_KUBELET_ROOT_DIR
    """The kubelet's root directory on the nodes (`--kubelet-root-dir`)."""
    agent_pod_labels: tuple[tuple[str, str], ...] = ()
    """Extra labels of the agent pods (`--agent-pod-label`); the operator's own win."""
    agent_pod_annotations: tuple[tuple[str, str], ...] = ()
    """Extra annotations of the agent pods (`--agent-pod-annotation`); the operator's win."""

    def __post_init__(self) -> None:
        check_namespace("--namespace", self.namespace)
        if self.admission_mode not in ADMISSION_MODES:
            raise SettingsError(
                "--admission-mode",
                self.admission_mode,
                "write webhook (the pod webhook mutates pods) or policy (a "
                "MutatingAdmissionPolicy per network; needs admissionregistration.k8s.io/v1 "
                "MutatingAdmissionPolicy, Kubernetes >= 1.36)",
            )
        if self.pod_security_default not in POD_SECURITY_LEVELS:
            raise SettingsError(
                "--pod-security-default",
                self.pod_security_default,
                "write privileged, baseline or restricted (the cluster's PodSecurity default)",
            )
        for secret in self.agent_image_pull_secrets:
            if not _DNS_SUBDOMAIN.match(secret):
                raise SettingsError(
                    "--agent-image-pull-secret",
                    secret,
                    "name a Secret of type kubernetes.io/dockerconfigjson in the agents' "
                    "namespace (a DNS subdomain)",
                )
        if self.agent_cluster_role is not None and not _DNS_SUBDOMAIN.match(
            self.agent_cluster_role
        ):
            raise SettingsError(
                "--agent-cluster-role",
                self.agent_cluster_role,
                "name the agents' ClusterRole of the chart (<fullname>-agent), a DNS subdomain",
            )
        check_image("--agent-image", self.agent_image)
        for image in self.extra_agent_images:
            check_image("--allowed-agent-image", image)
        self._check_agent_pod_defaults()

    def _check_agent_pod_defaults(self) -> None:
        if self.agent_image_pull_policy not in PULL_POLICIES:
            raise SettingsError(
                "--agent-image-pull-policy",
                self.agent_image_pull_policy,
                "write Always, IfNotPresent or Never",
            )
        for toleration in self.agent_tolerations:
            check_toleration("--agent-toleration", toleration)
        if self.agent_priority_class and not _DNS_SUBDOMAIN.match(self.agent_priority_class):
            raise SettingsError(
                "--agent-priority-class",
                self.agent_priority_class,
                "name a PriorityClass (a DNS subdomain), or give '' for none",
            )
        root = self.kubelet_root_dir
        if not root.startswith("/") or root != "/" + "/".join(p for p in root.split("/") if p):
            raise SettingsError(
                "--kubelet-root-dir",
                root,
                "give the kubelet's --root-dir as an absolute path without a trailing '/', "
                "e.g. /var/lib/kubelet (k0s: /var/lib/k0s/kubelet)",
            )
        for flag, pairs in (
            ("--agent-pod-label", self.agent_pod_labels),
            ("--agent-pod-annotation", self.agent_pod_annotations),
        ):
            for key, value in pairs:
                if not _LABEL_NAME.match(key):
                    raise SettingsError(
                        flag,
                        f"{key}={value}",
                        "a key is [prefix/]name: a DNS prefix and <= 63 chars",
                    )
                if flag == "--agent-pod-label" and not _LABEL_VALUE.match(value):
                    raise SettingsError(
                        flag,
                        f"{key}={value}",
                        "a label value is <= 63 letters, digits, '-', '_' or '.', starting and "
                        "ending with a letter or digit",
                    )

    @property
    def allowed_agent_images(self) -> tuple[str, ...]:
        """The agent images this operator runs: its default, then the flags' (exact
        references: a digest pins one build, a tag what the registry serves for it)."""
        return tuple(dict.fromkeys((self.agent_image, *self.extra_agent_images)))


def check_toleration(flag: str, value: object) -> dict[str, Any]:
    """A core/v1 Toleration as JSON, checked as the API checks spec.tolerations."""
    if not isinstance(value, dict):
        raise SettingsError(
            flag,
            value,
            'give one toleration as a JSON object, e.g. {"key": '
            '"nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}',
        )
    try:
        return Toleration.model_validate(value).to_api()
    except ValueError as exc:
        raise SettingsError(flag, value, f"not a valid toleration: {exc}") from None


def parse_key_value(flag: str, text: str) -> tuple[str, str]:
    """`KEY=VALUE` of a label or annotation flag."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SettingsError(flag, text, "write KEY=VALUE, e.g. team=ml")
    return key, value


def check_secret_ref(flag: str, value: str) -> tuple[str, str]:
    """`NAMESPACE/NAME` of a Secret -> (namespace, name)."""
    namespace, sep, name = value.partition("/")
    if not sep or not _DNS_LABEL.match(namespace) or not _DNS_SUBDOMAIN.match(name):
        raise SettingsError(
            flag,
            value,
            "write NAMESPACE/NAME of the webhook certificate Secret, e.g. "
            "metaroce-system/metaroce-webhook-tls (the chart's metaroce.certSecret)",
        )
    return namespace, name


@dataclass(frozen=True)
class WebhookSettings:
    """The admission webhooks every replica serves (`--webhook-*`)."""

    port: int = 0
    """HTTPS port of the webhooks; 0 = this process serves no webhooks."""
    cert_secret: str | None = None
    """`namespace/name` of the Secret with the serving certificate (read by every replica,
    written by the leader unless `cert_manager`). Its namespace is the Service's."""
    service: str | None = None
    """The webhook Service (the certificate names `<service>.<namespace>.svc`)."""
    mutating_config: str | None = None
    """MutatingWebhookConfiguration whose caBundle the leader writes."""
    validating_config: str | None = None
    """ValidatingWebhookConfiguration whose caBundle the leader writes."""
    cert_manager: bool = False
    """cert-manager owns the Secret and injects the caBundles: never write either."""
    cert_check_interval: float = 60.0
    """How often the leader checks the Secret (rotation before expiry) and the caBundles."""

    @property
    def enabled(self) -> bool:
        return self.port > 0

    @property
    def secret_ref(self) -> tuple[str, str]:
        assert self.cert_secret is not None
        return check_secret_ref("--webhook-cert-secret", self.cert_secret)

    def __post_init__(self) -> None:
        check_port("--webhook-port", self.port)
        if self.cert_check_interval < 1:
            raise SettingsError(
                "--webhook-cert-check-interval", self.cert_check_interval, "use at least 1s"
            )
        if self.cert_secret is not None:
            check_secret_ref("--webhook-cert-secret", self.cert_secret)
        if self.service is not None and not _DNS_LABEL.match(self.service):
            raise SettingsError(
                "--webhook-service", self.service, "a Service name is a DNS label (lowercase)"
            )
        for flag, value in (
            ("--webhook-mutating-config", self.mutating_config),
            ("--webhook-validating-config", self.validating_config),
        ):
            if value is not None and not _DNS_SUBDOMAIN.match(value):
                raise SettingsError(
                    flag, value, "a webhook configuration name is a DNS subdomain (lowercase)"
                )
        if not self.enabled:
            return
        if self.cert_secret is None:
            raise SettingsError(
                "--webhook-cert-secret",
                None,
                "serving webhooks (--webhook-port > 0) needs the certificate Secret: pass "
                "NAMESPACE/NAME (the chart's <fullname>-webhook-tls), or --webhook-port=0",
            )
        if self.cert_manager:
            return
        if self.service is None:
            raise SettingsError(
                "--webhook-service",
                None,
                "the leader issues the certificate for the webhook Service: pass its name "
                "(the chart's <fullname>-webhook), or --webhook-cert-manager",
            )
        if self.mutating_config is None and self.validating_config is None:
            raise SettingsError(
                "--webhook-mutating-config",
                None,
                "the leader writes the CA into the webhook configurations: pass "
                "--webhook-mutating-config and --webhook-validating-config (the chart's "
                "<fullname>-pods and <fullname>-networks), or --webhook-cert-manager",
            )


@dataclass(frozen=True)
class OperatorSettings:
    """Everything the running operator is told."""

    render: RenderSettings = field(default_factory=RenderSettings)
    identity: str = field(default_factory=default_identity)
    """This replica's name in the Lease."""
    lease_name: str = DEFAULT_LEASE_NAME
    lease_namespace: str = DEFAULT_NAMESPACE
    lease_duration: float = 15.0
    """Seconds a follower waits after the last renewal it saw before taking over."""
    renew_deadline: float = 10.0
    """A leader that could not renew for this long stops acting (before others may take over)."""
    retry_period: float = 2.0
    """Seconds between renewals and between a follower's attempts."""
    status_interval: float = 2.0
    """Status writes of one network are batched: at most one per interval."""
    housekeeping_interval: float = 15.0
    """Period of the node pass: stale NodeStates, taints, NIC conflicts."""
    cleanup_timeout: float = 300.0
    """How long a deleted network with cleanupOnDelete waits for the agents' reverted reports."""
    nodestate_grace: float = 60.0
    """A NodeState younger than this is never garbage-collected (its node may be joining)."""
    metrics_port: int = 8080
    health_port: int = 8081
    bind_address: str = "0.0.0.0"
    kubeconfig: str | None = None
    log_level: str = "info"
    webhook: WebhookSettings = field(default_factory=WebhookSettings)

    def __post_init__(self) -> None:
        if not self.identity or len(self.identity) > 128:
            raise SettingsError("--identity", self.identity, "give a non-empty name <= 128 chars")
        if not _DNS_SUBDOMAIN.match(self.lease_name):
            raise SettingsError(
                "--lease-name", self.lease_name, "a Lease name is a DNS subdomain (lowercase)"
            )
        check_namespace("--lease-namespace", self.lease_namespace)
        if self.lease_duration < 2:
            raise SettingsError("--lease-duration", self.lease_duration, "use at least 2s")
        if not 0 < self.renew_deadline < self.lease_duration:
            raise SettingsError(
                "--renew-deadline",
                self.renew_deadline,
                f"must be above 0 and below --lease-duration ({self.lease_duration:g}s), so "
                "a leader stops acting before a follower may take over",
            )
        if not 0 < self.retry_period < self.renew_deadline:
            raise SettingsError(
                "--retry-period",
                self.retry_period,
                f"must be above 0 and below --renew-deadline ({self.renew_deadline:g}s)",
            )
        if self.status_interval < 0.1:
            raise SettingsError("--status-interval", self.status_interval, "use at least 0.1s")
        if self.housekeeping_interval < 1:
            raise SettingsError(
                "--housekeeping-interval", self.housekeeping_interval, "use at least 1s"
            )
        check_port("--metrics-port", self.metrics_port)
        check_port("--health-port", self.health_port)
        if self.metrics_port and self.metrics_port == self.health_port:
            raise SettingsError(
                "--health-port", self.health_port, "must differ from --metrics-port"
            )
        if self.webhook.enabled and self.webhook.port in (self.metrics_port, self.health_port):
            raise SettingsError(
                "--webhook-port",
                self.webhook.port,
                "must differ from --metrics-port and --health-port",
            )
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SettingsError(
                "--log-level", self.log_level, "choose one of debug, info, warning, error"
            )
        if self.kubeconfig is not None and not os.path.isfile(self.kubeconfig):
            raise SettingsError(
                "--kubeconfig", self.kubeconfig, "no such file: give a kubeconfig path or omit"
            )
