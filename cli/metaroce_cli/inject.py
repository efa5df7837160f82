"""`metaroce inject --dry-run -f pod.yaml [--network N]`: what the pod webhook would change.

It calls the webhook's own pure `mutate_pod` on the pod, with the networks read from
`--networks-file` (offline) or the cluster, and prints the JSON patch the webhook would
return (exactly), its warnings on stderr, or the webhook's refusal (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from metaroce_api.constants import (
    API_VERSION,
    GROUP,
    NETWORK_KIND,
    NETWORK_PLURAL,
    NETWORKS_ANNOTATION,
    VERSION,
)
from metaroce_cli.cluster import connect
from metaroce_operator.webhooks.cache import view_of
from metaroce_operator.webhooks.mutate import (
    DEFAULT_ATTACHMENT_NAMESPACE,
    Allowed,
    Namespace,
    NetworkView,
    mutate_pod,
)


class InputError(ValueError):
    """A user input that cannot be used; the message names it and the fix."""


def load_pod(text: str, source: str) -> dict[str, Any]:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise InputError(f"{source}: not YAML: {e}") from e
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise InputError(f"{source}: expected one Pod object, found {len(docs)} documents")
    pod = docs[0]
    if pod.get("kind") != "Pod":
        raise InputError(
            f"{source}: kind is {pod.get('kind')!r}, not 'Pod': the webhook mutates pods; "
            "pass the pod (e.g. a Job's spec.template as a Pod)"
        )
    return pod


def with_networks(pod: Mapping[str, Any], networks: Sequence[str]) -> dict[str, Any]:
    """A copy of `pod` annotated with `networks` (as if the user had written it)."""
    out: dict[str, Any] = json.loads(json.dumps(pod))
    if networks:
        meta = out.setdefault("metadata", {})
        meta.setdefault("annotations", {})[NETWORKS_ANNOTATION] = ",".join(networks)
    return out


def views_from_documents(docs: Sequence[Any]) -> dict[str, NetworkView]:
    """NetworkViews of the MetaRoceNetwork documents among `docs`, as the webhook's cache
    parses them (an invalid one is a view with its problem)."""
    return {
        v.name: v
        for v in (view_of(d) for d in docs if isinstance(d, dict) and d.get("kind") == NETWORK_KIND)
    }


def dry_run(
    pod: Mapping[str, Any],
    views: Mapping[str, NetworkView],
    namespace: Namespace,
    *,
    check_pod_security: bool = True,
    default_pod_security: str = "privileged",
    attachment_namespace: str = DEFAULT_ATTACHMENT_NAMESPACE,
) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of one dry run; the webhook's decision, unchanged."""
    decision = mutate_pod(
        pod,
        views,
        namespace,
        check_pod_security=check_pod_security,
        default_pod_security=default_pod_security,
        attachment_namespace=attachment_namespace,
    )
    if not isinstance(decision, Allowed):
        return 1, "", [f"the webhook would refuse the pod: {decision.message}"]
    notes = [f"warning: {w}" for w in decision.warnings]
    if NETWORKS_ANNOTATION not in ((pod.get("metadata") or {}).get("annotations") or {}):
        notes.append(
            f"the pod has no {NETWORKS_ANNOTATION} annotation: the webhook leaves it unchanged "
            "(pass --network N to see what attaching network N does)"
        )
    return 0, json.dumps(decision.patch, indent=2) + "\n", notes


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="metaroce inject", description=__doc__)
    p.add_argument("--dry-run", action="store_true", help="required: print, change nothing")
    p.add_argument("-f", "--filename", required=True, help="the pod's YAML (- for stdin)")
    p.add_argument(
        "--network",
        action="append",
        default=[],
        help=f"attach this network (sets {NETWORKS_ANNOTATION}); repeatable",
    )
    p.add_argument(
        "--networks-file",
        action="append",
        default=[],
        help="MetaRoceNetwork YAML to use instead of the cluster's (offline); repeatable",
    )
    p.add_argument("--namespace", help="the pod's namespace (default: its own, else default)")
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument(
        "--default-pod-security",
        default="privileged",
        help="the cluster's default Pod Security enforce level (the webhook's setting)",
    )
    p.add_argument(
        "--agents-namespace",
        default=DEFAULT_ATTACHMENT_NAMESPACE,
        help="the release's namespace, where the networks' NetworkAttachmentDefinitions are "
        f"(the webhook's setting; default {DEFAULT_ATTACHMENT_NAMESPACE})",
    )
    args = p.parse_args(list(argv))
    if not args.dry_run:
        print(
            "metaroce inject: only --dry-run exists: it prints the webhook's patch; the "
            "webhook itself mutates pods when they are created. Add --dry-run",
            file=sys.stderr,
        )
        return 2
    try:
        source = "stdin" if args.filename == "-" else args.filename
        text = sys.stdin.read() if args.filename == "-" else _read(Path(args.filename))
        pod = with_networks(load_pod(text, source), args.network)
        namespace = args.namespace or (pod.get("metadata") or {}).get("namespace") or "default"
        views, labels, notes = _networks_and_namespace(args, namespace)
    except InputError as e:
        print(f"metaroce inject: {e}", file=sys.stderr)
        return 2
    rc, out, more = dry_run(
        pod,
        views,
        Namespace(namespace, labels),
        default_pod_security=args.default_pod_security,
        attachment_namespace=args.agents_namespace,
    )
    if args.network:
        notes.append(
            f"as if the pod had the annotation {NETWORKS_ANNOTATION}: {','.join(args.network)} "
            "(the webhook acts on annotated pods only: add it to the pod)"
        )
    for line in [*notes, *more]:
        print(line, file=sys.stderr)
    sys.stdout.write(out)
    return rc


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise InputError(f"-f {path}: cannot read it: {e.strerror or e}") from e


def _networks_and_namespace(
    args: argparse.Namespace, namespace: str
) -> tuple[dict[str, NetworkView], Mapping[str, str] | None, list[str]]:
    """Networks from --networks-file, else from the cluster; the namespace's labels from the
    cluster when it answers (unknown offline: the webhook then checks no Pod Security)."""
    notes: list[str] = []
    views: dict[str, NetworkView] = {}
    for name in args.networks_file:
        try:
            views.update(views_from_documents(list(yaml.safe_load_all(_read(Path(name))))))
        except yaml.YAMLError as e:
            raise InputError(f"--networks-file {name}: not YAML: {e}") from e
    client, why = connect(args.kubeconfig)
    if client is None:
        if not args.networks_file:
            raise InputError(
                f"no networks to mutate with: {why}; pass --networks-file with the "
                "MetaRoceNetwork YAML to run offline"
            )
        notes.append(f"namespace {namespace!r}: labels unknown offline ({why})")
        return views, None, notes
    from metaroce_agent.kube import KubeError

    labels: Mapping[str, str] | None = None
    try:
        if not args.networks_file:
            listed = client.request("GET", f"/apis/{GROUP}/{VERSION}/{NETWORK_PLURAL}")
            views = views_from_documents(
                [
                    {"apiVersion": API_VERSION, "kind": NETWORK_KIND, **item}
                    for item in listed.get("items") or []
                ]
            )
        ns = client.get(f"/api/v1/namespaces/{namespace}")
        labels = ((ns or {}).get("metadata") or {}).get("labels") or {}
    except KubeError as e:
        if not args.networks_file:
            raise InputError(
                f"cannot read the networks from the cluster ({e}); pass --networks-file "
                "to run offline"
            ) from e
        notes.append(f"namespace {namespace!r}: labels unknown ({e})")
    finally:
        client.close()
    return views, labels, notes
