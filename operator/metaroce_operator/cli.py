"""`metaroce operator` (run the operator) and `metaroce render` (print children offline).

Flags have environment fallbacks so that the chart can use the downward API (POD_NAME,
POD_NAMESPACE); every value is validated with an error naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from metaroce_api import InvalidObject, failpoints, validate_network
from metaroce_api import constants as c
from metaroce_operator import __version__
from metaroce_operator.render import render_network
from metaroce_operator.settings import (
    DEFAULT_AGENT_IMAGE,
    DEFAULT_AGENT_PRIORITY_CLASS,
    DEFAULT_KUBELET_ROOT_DIR,
    DEFAULT_LEASE_NAME,
    DEFAULT_NAMESPACE,
    OperatorSettings,
    RenderSettings,
    SettingsError,
    WebhookSettings,
    check_port,
    default_identity,
    parse_key_value,
    parse_seconds,
)

METRICS_PORT = 8080
HEALTH_PORT = 8081
WEBHOOK_PORT = 8443


def chart_arguments(
    namespace: str,
    agent_image: str,
    fullname: str = "metaroce",
    webhook_port: int = WEBHOOK_PORT,
    cert_manager: bool = False,
    allowed_agent_images: Sequence[str] = (),
    admission_mode: str = "webhook",
    image_pull_secrets: Sequence[str] = (),
    agent_pod_defaults: AgentPodDefaults | None = None,
) -> list[str]:
    """The arguments the Helm chart passes to `metaroce operator`.

    The chart's Deployment must use exactly these (tests start the operator with them);
    the identity and namespace also come from POD_NAME / POD_NAMESPACE (downward API).
    The webhook names follow charts/metaroce/templates/_helpers.tpl (metaroce.certSecret,
    metaroce.webhookService) and the chart's `<fullname>-pods` / `<fullname>-networks`.
    """
    args = [
        f"--namespace={namespace}",
        f"--agent-image={agent_image}",
        f"--agent-cluster-role={fullname}-agent",
        f"--metrics-port={METRICS_PORT}",
        f"--health-port={HEALTH_PORT}",
        "--log-level=info",
        f"--webhook-port={webhook_port}",
        f"--webhook-cert-secret={namespace}/"
        + c.WEBHOOK_CERT_SECRET_TEMPLATE.format(fullname=fullname),
        "--webhook-service=" + c.WEBHOOK_SERVICE_TEMPLATE.format(fullname=fullname),
        *(
            ["--admission-mode=policy"]
            if admission_mode == "policy"
            else [
                "--webhook-mutating-config="
                + c.POD_WEBHOOK_CONFIG_TEMPLATE.format(fullname=fullname)
            ]
        ),
        "--webhook-validating-config="
        + c.NETWORK_WEBHOOK_CONFIG_TEMPLATE.format(fullname=fullname),
    ]
    if cert_manager:
        args.append("--webhook-cert-manager")
    args += [f"--allowed-agent-image={image}" for image in allowed_agent_images]
    args += [f"--agent-image-pull-secret={name}" for name in image_pull_secrets]
    return args + (agent_pod_defaults or AgentPodDefaults()).arguments()


@dataclass(frozen=True)
class AgentPodDefaults:
    """The chart's cluster-wide agent pod values (agent.*), as `metaroce operator` flags.

    Each flag is passed only when its value differs from the operator's default, the
    way charts/metaroce/templates/_helpers.tpl `metaroce.operatorArgs` writes them."""

    pull_policy: str = "IfNotPresent"
    tolerations: Sequence[Mapping[str, Any]] = ()
    priority_class: str = DEFAULT_AGENT_PRIORITY_CLASS
    kubelet_root_dir: str = DEFAULT_KUBELET_ROOT_DIR
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)

    def arguments(self) -> list[str]:
        args = []
        if self.pull_policy != "IfNotPresent":
            args.append(f"--agent-image-pull-policy={self.pull_policy}")
        args += [f"--agent-toleration={_go_json(t)}" for t in self.tolerations]
        if self.priority_class != DEFAULT_AGENT_PRIORITY_CLASS:
            args.append(f"--agent-priority-class={self.priority_class}")
        if self.kubelet_root_dir != DEFAULT_KUBELET_ROOT_DIR:
            args.append(f"--kubelet-root-dir={self.kubelet_root_dir}")
        args += [f"--agent-pod-label={k}={v}" for k, v in sorted(self.pod_labels.items())]
        args += [f"--agent-pod-annotation={k}={v}" for k, v in sorted(self.pod_annotations.items())]
        return args


def _go_json(value: Any) -> str:
    """JSON as Helm's `toJson` writes it (Go: sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _env(*names: str, default: str | None = None) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return default


def _port(flag: str) -> Any:
    def parse(text: str) -> int:
        try:
            return check_port(flag, int(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None

    return parse


def _operator_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="metaroce operator",
        description="Run the MetaRoCE operator (leader-elected; safe to run several replicas).",
    )
    p.add_argument(
        "--namespace",
        default=_env("METAROCE_NAMESPACE", "POD_NAMESPACE", default=DEFAULT_NAMESPACE),
        help="namespace of the agents and of the lease (env METAROCE_NAMESPACE, "
        f"POD_NAMESPACE; default {DEFAULT_NAMESPACE})",
    )
    p.add_argument(
        "--agent-image",
        default=_env("METAROCE_AGENT_IMAGE", default=DEFAULT_AGENT_IMAGE),
        help="agent image when a network does not set spec.agent.image "
        f"(env METAROCE_AGENT_IMAGE; default {DEFAULT_AGENT_IMAGE})",
    )
    p.add_argument(
        "--allowed-agent-image",
        action="append",
        default=[],
        metavar="IMAGE",
        help="an image a network may set in spec.agent.image, besides --agent-image "
        "(repeatable; exact references, by digest where you can): the agents run "
        "privileged on the nodes, so no other image is run (the chart's agent.allowedImages)",
    )
    p.add_argument(
        "--agent-image-pull-secret",
        action="append",
        default=[],
        metavar="SECRET",
        help="a Secret in the agents' namespace the agent pods pull their image with "
        "(repeatable; the chart's imagePullSecrets)",
    )
    p.add_argument(
        "--agent-image-pull-policy",
        default="IfNotPresent",
        help="imagePullPolicy of the agent containers (the chart's agent.image.pullPolicy)",
    )
    p.add_argument(
        "--agent-toleration",
        action="append",
        default=[],
        metavar="JSON",
        help="a toleration every agent DaemonSet gets besides its network's, as JSON "
        "(repeatable; the chart's agent.tolerations), e.g. for GPU node taints",
    )
    p.add_argument(
        "--agent-priority-class",
        default=DEFAULT_AGENT_PRIORITY_CLASS,
        metavar="NAME",
        help=f"priorityClassName of the agent pods ('' = none; default "
        f"{DEFAULT_AGENT_PRIORITY_CLASS}; the chart's agent.priorityClassName)",
    )
    p.add_argument(
        "--kubelet-root-dir",
        default=DEFAULT_KUBELET_ROOT_DIR,
        metavar="PATH",
        help="the kubelet's root directory on the nodes, holding device-plugins/ and "
        f"pod-resources/ (default {DEFAULT_KUBELET_ROOT_DIR}; k0s: /var/lib/k0s/kubelet; "
        "the chart's agent.kubeletRootDir)",
    )
    p.add_argument(
        "--agent-pod-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label of every agent pod (repeatable; the chart's agent.podLabels)",
    )
    p.add_argument(
        "--agent-pod-annotation",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an annotation of every agent pod (repeatable; the chart's agent.podAnnotations)",
    )
    p.add_argument(
        "--agent-cluster-role",
        default=None,
        metavar="NAME",
        help="the agents' ClusterRole (the chart's <fullname>-agent): each network's "
        "ClusterRoleBinding names it, so the operator needs only `bind` on it. Without it, "
        "a ClusterRole per network, which needs write access to ClusterRoles",
    )
    p.add_argument(
        "--identity", default=None, help="name in the lease (default: POD_NAME, else host-pid)"
    )
    p.add_argument("--lease-name", default=DEFAULT_LEASE_NAME, help="Lease object name")
    p.add_argument(
        "--lease-namespace", default=None, help="namespace of the Lease (default: --namespace)"
    )
    p.add_argument("--lease-duration", default="15s", help="lease duration (default 15s)")
    p.add_argument("--renew-deadline", default="10s", help="leader gives up after (default 10s)")
    p.add_argument("--retry-period", default="2s", help="renew / retry period (default 2s)")
    p.add_argument("--status-interval", default="2s", help="status batch interval (default 2s)")
    p.add_argument("--housekeeping-interval", default="15s", help="node pass period (default 15s)")
    p.add_argument("--cleanup-timeout", default="5m", help="wait for reverted nodes (default 5m)")
    p.add_argument("--nodestate-grace", default="60s", help="min age of a collected NodeState")
    p.add_argument(
        "--metrics-port", type=_port("--metrics-port"), default=METRICS_PORT, help="0 = off"
    )
    p.add_argument(
        "--health-port", type=_port("--health-port"), default=HEALTH_PORT, help="0 = off"
    )
    p.add_argument(
        "--admission-mode",
        default="webhook",
        help="how annotated pods are mutated: webhook (the pod webhook of every replica; "
        "the default) or policy (a MutatingAdmissionPolicy per network, run by the "
        "apiserver itself; the chart picks policy where the cluster serves it)",
    )
    p.add_argument(
        "--pod-security-default",
        default="privileged",
        help="the cluster's PodSecurity default enforce level, for namespaces without the "
        "label (policy mode: such namespaces get no IPC_LOCK; default privileged)",
    )
    p.add_argument("--bind-address", default="0.0.0.0", help="address of the HTTP(S) endpoints")
    p.add_argument(
        "--webhook-port",
        type=_port("--webhook-port"),
        default=0,
        help="HTTPS port of the admission webhooks, served by every replica (0 = off, the "
        "default; the chart passes 8443)",
    )
    p.add_argument(
        "--webhook-cert-secret",
        metavar="NAMESPACE/NAME",
        help="Secret with the webhook's serving certificate: every replica reads it, the "
        "leader creates and rotates it (unless --webhook-cert-manager)",
    )
    p.add_argument(
        "--webhook-service", help="the webhook Service (the certificate is issued for it)"
    )
    p.add_argument(
        "--webhook-mutating-config",
        help="MutatingWebhookConfiguration whose caBundle the leader writes",
    )
    p.add_argument(
        "--webhook-validating-config",
        help="ValidatingWebhookConfiguration whose caBundle the leader writes",
    )
    p.add_argument(
        "--webhook-cert-check-interval",
        default="60s",
        help="how often the leader checks the certificate Secret (renewed before it "
        "expires) and the caBundles (default 60s)",
    )
    p.add_argument(
        "--webhook-cert-manager",
        action="store_true",
        help="cert-manager issues the Secret and injects the caBundles: never write them",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig (default: in-cluster, $KUBECONFIG)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    p.add_argument("--version", action="version", version=f"metaroce-operator {__version__}")
    return p


def _json_flag(flag: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SettingsError(flag, text, f"not JSON ({exc.msg} at {exc.pos})") from None


def settings_from_args(argv: Sequence[str]) -> OperatorSettings:
    """Parse and validate; raises SettingsError / SystemExit (argparse) on bad input."""
    args = _operator_parser().parse_args(list(argv))
    render = RenderSettings(
        namespace=args.namespace,
        agent_image=args.agent_image,
        extra_agent_images=tuple(args.allowed_agent_image),
        admission_mode=args.admission_mode,
        pod_security_default=args.pod_security_default,
        agent_cluster_role=args.agent_cluster_role,
        agent_image_pull_secrets=tuple(args.agent_image_pull_secret),
        agent_image_pull_policy=args.agent_image_pull_policy,
        agent_tolerations=tuple(_json_flag("--agent-toleration", t) for t in args.agent_toleration),
        agent_priority_class=args.agent_priority_class,
        kubelet_root_dir=args.kubelet_root_dir,
        agent_pod_labels=tuple(
            parse_key_value("--agent-pod-label", a) for a in args.agent_pod_label
        ),
        agent_pod_annotations=tuple(
            parse_key_value("--agent-pod-annotation", a) for a in args.agent_pod_annotation
        ),
    )
    return OperatorSettings(
        render=render,
        identity=args.identity or default_identity(),
        lease_name=args.lease_name,
        lease_namespace=args.lease_namespace or args.namespace,
        lease_duration=parse_seconds("--lease-duration", args.lease_duration),
        renew_deadline=parse_seconds("--renew-deadline", args.renew_deadline),
        retry_period=parse_seconds("--retry-period", args.retry_period),
        status_interval=parse_seconds("--status-interval", args.status_interval),
        housekeeping_interval=parse_seconds("--housekeeping-interval", args.housekeeping_interval),
        cleanup_timeout=parse_seconds("--cleanup-timeout", args.cleanup_timeout),
        nodestate_grace=parse_seconds("--nodestate-grace", args.nodestate_grace),
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        bind_address=args.bind_address,
        kubeconfig=args.kubeconfig,
        log_level=args.log_level,
        webhook=WebhookSettings(
            port=args.webhook_port,
            cert_secret=args.webhook_cert_secret,
            service=args.webhook_service,
            mutating_config=args.webhook_mutating_config,
            validating_config=args.webhook_validating_config,
            cert_manager=args.webhook_cert_manager,
            cert_check_interval=parse_seconds(
                "--webhook-cert-check-interval", args.webhook_cert_check_interval
            ),
        ),
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if level != "debug":
        # kopf logs every handler call of every object at INFO: thousands per rollout.
        logging.getLogger("kopf").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


RETIRED_CRASH_ENV = "METAROCE_TEST_CRASH_AT"
"""The old kill switch, replaced by failpoints (rollout.after_configmap,
rollout.after_daemonset, status.before_write)."""


def check_test_environment() -> None:
    """Refuse a failpoint spec that does not parse, and the retired kill switch, instead
    of a test that silently never kills."""
    retired = os.environ.get(RETIRED_CRASH_ENV)
    if retired:
        raise SettingsError(
            RETIRED_CRASH_ENV,
            retired,
            f"this switch is gone: use {failpoints.ENV}=<point>=1 with the point "
            "rollout.after_configmap, rollout.after_daemonset or status.before_write "
            "(see metaroce_api/failpoints.py), or unset it",
        )
    spec = os.environ.get(failpoints.ENV, "")
    try:
        failpoints.parse(spec)
    except ValueError as err:
        raise SettingsError(failpoints.ENV, spec, str(err)) from None


def run_main(argv: Sequence[str]) -> int:
    """`metaroce operator [flags]`."""
    try:
        check_test_environment()
        settings = settings_from_args(argv)
    except SettingsError as err:
        print(f"metaroce operator: error: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    from metaroce_operator.app import run

    logging.getLogger("metaroce.operator").info(
        "metaroce-operator %s as %s: agents in %s, lease %s/%s",
        __version__,
        settings.identity,
        settings.render.namespace,
        settings.lease_namespace,
        settings.lease_name,
    )
    return run(settings)


# --- render ---------------------------------------------------------------------------------


def _render_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="metaroce render",
        description=(
            "Print the objects the operator creates for a MetaRoceNetwork, offline (for "
            "review and GitOps). Owner references are left out: they need the network's uid."
        ),
    )
    p.add_argument("-f", "--filename", required=True, help="network YAML file ('-' for stdin)")
    p.add_argument("--agent-image", default=DEFAULT_AGENT_IMAGE, help="default agent image")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="namespace of the agents")
    p.add_argument(
        "--admission-mode",
        default="webhook",
        help="policy: also render each network's MutatingAdmissionPolicy and binding",
    )
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    return p


def _read_networks(source: str) -> list[dict[str, Any]]:
    if source == "-":
        text = sys.stdin.read()
    else:
        path = Path(source)
        if not path.is_file():
            raise SettingsError("-f", source, "no such file: give the path of a network YAML")
        text = path.read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SettingsError("-f", source, f"not valid YAML ({err}); fix the file") from None
    networks = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict) or doc.get("kind") != c.NETWORK_KIND:
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise SettingsError(
                "-f",
                source,
                f"document {i + 1} is a {kind}, not a {c.NETWORK_KIND}: render takes networks only",
            )
        networks.append(doc)
    if not networks:
        raise SettingsError("-f", source, f"the file holds no {c.NETWORK_KIND}")
    return networks


def render_main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """`metaroce render -f network.yaml [--agent-image IMAGE] [--namespace NS] [-o json]`."""
    out = out or sys.stdout
    args = _render_parser().parse_args(list(argv))
    try:
        settings = RenderSettings(
            namespace=args.namespace,
            agent_image=args.agent_image,
            admission_mode=args.admission_mode,
        )
        docs = _read_networks(args.filename)
        objects: list[dict[str, Any]] = []
        for doc in docs:
            objects += render_network(validate_network(doc), settings)
    except (SettingsError, InvalidObject) as err:
        print(f"metaroce render: error: {err}", file=sys.stderr)
        return 1
    if args.output == "json":
        json.dump({"apiVersion": "v1", "kind": "List", "items": objects}, out, indent=2)
        out.write("\n")
    else:
        out.write(f"# metaroce render (metaroce-operator {__version__}); no owner references.\n")
        out.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0
