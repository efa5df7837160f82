"""`metaroce version`: this package's version and, when the cluster answers, the images of
the operator deployments running in it (offline: says why it did not look)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from metaroce_cli.cluster import connect

DISTRIBUTION = "metaroce"
OPERATOR_SELECTOR = "app.kubernetes.io/name=metaroce,app.kubernetes.io/component=operator"
"""The chart's labels on the operator Deployment (charts/metaroce/templates)."""


def package_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        from metaroce_operator import __version__

        return f"{__version__} (source tree, not installed)"


def operator_versions(deployments: Mapping[str, Any]) -> list[str]:
    """One line per operator Deployment of a DeploymentList: where, image, chart version."""
    lines = []
    for d in deployments.get("items") or []:
        meta = d.get("metadata") or {}
        labels = meta.get("labels") or {}
        containers = (((d.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
            "containers"
        ) or []
        images = ", ".join(str(c.get("image")) for c in containers if c.get("image"))
        app = labels.get("app.kubernetes.io/version", "unknown")
        lines.append(
            f"operator: {meta.get('namespace')}/{meta.get('name')} image {images or 'unknown'}"
            f" (app version {app})"
        )
    return lines


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="metaroce version", description=__doc__)
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--offline", action="store_true", help="do not ask the cluster")
    args = p.parse_args(list(argv))
    print(f"metaroce {package_version()}")
    if args.offline:
        return 0
    client, why = connect(args.kubeconfig)
    if client is None:
        print(f"operator: not checked ({why})")
        return 0
    from metaroce_agent.kube import KubeError

    try:
        found = client.request(
            "GET", "/apis/apps/v1/deployments", params={"labelSelector": OPERATOR_SELECTOR}
        )
    except KubeError as e:
        print(f"operator: cluster not reachable ({e})")
        return 0
    finally:
        client.close()
    print("\n".join(operator_versions(found)) or "operator: not installed in this cluster")
    return 0
