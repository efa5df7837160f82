"""Drift of a child from what the operator rendered (pure): which owned fields differ.

Server-side apply with `force` restores whatever the operator renders, but only when it
applies; a child edited behind its back (an image, a securityContext, the agents' RBAC)
stayed wrong until the next reconcile. The watch events of the children are compared
with the last rendered objects on the fields that matter for what runs on the nodes and
with which rights; only a difference triggers a re-apply, which is a no-op write when
nothing differs, so no event and no loop follow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POD_FIELDS = ("serviceAccountName", "hostNetwork", "hostPID", "hostIPC", "volumes")
CONTAINER_FIELDS = ("image", "command", "args", "securityContext", "volumeMounts")


def _containers(pod: Mapping[str, Any], kind: str) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("name")): c for c in pod.get(kind) or [] if isinstance(c, Mapping)}


def _subset(rendered: Any, observed: Any) -> bool:
    """Every value we rendered is there (the apiserver only adds defaults)."""
    if isinstance(rendered, Mapping):
        return isinstance(observed, Mapping) and all(
            _subset(v, observed.get(k)) for k, v in rendered.items()
        )
    if isinstance(rendered, list):
        return (
            isinstance(observed, list)
            and len(rendered) == len(observed)
            and all(_subset(r, o) for r, o in zip(rendered, observed, strict=True))
        )
    return bool(rendered == observed)


def daemonset_drift(rendered: Mapping[str, Any], observed: Mapping[str, Any]) -> list[str]:
    """The pod-template fields of an agent DaemonSet that differ from the rendered ones."""
    want = ((rendered.get("spec") or {}).get("template") or {}).get("spec") or {}
    have = ((observed.get("spec") or {}).get("template") or {}).get("spec") or {}
    out = [f for f in POD_FIELDS if f in want and not _subset(want[f], have.get(f))]
    out += [f for f in POD_FIELDS if f not in want and have.get(f) not in (None, False, [])]
    for kind in ("initContainers", "containers"):
        mine, theirs = _containers(want, kind), _containers(have, kind)
        if set(mine) != set(theirs):
            out.append(f"{kind} (names)")
            continue
        for name, container in mine.items():
            for f in CONTAINER_FIELDS:
                ours, seen = container.get(f), theirs[name].get(f)
                if f == "securityContext" or f == "image":
                    same = ours == seen  # no defaults there: any addition is an edit
                else:
                    same = _subset(ours, seen) if ours is not None else seen in (None, [])
                if not same:
                    out.append(f"{kind}[{name}].{f}")
    return out


def rbac_drift(rendered: Mapping[str, Any], observed: Mapping[str, Any]) -> list[str]:
    """A ClusterRole's rules, a ClusterRoleBinding's roleRef and subjects."""
    fields = ("rules",) if rendered.get("kind") == "ClusterRole" else ("roleRef", "subjects")
    return [f for f in fields if not _subset(rendered.get(f), observed.get(f))]
