"""Server-side apply of a network's rendered children, under the operator's one field
manager (`constants.FIELD_MANAGER`) with `force`: the operator owns what it renders, and
an identical apply is a no-op the apiserver does not even write (a restart re-applies
everything without bumping a generation or rolling an agent)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from metaroce_api import constants as c
from metaroce_operator.kube import ApiError, Kube


class ApplyFailed(Exception):
    """One child could not be applied; `obj` says which."""

    def __init__(self, obj: Mapping[str, Any], error: ApiError) -> None:
        meta = obj.get("metadata") or {}
        where = f"{meta['namespace']}/" if meta.get("namespace") else ""
        self.obj = obj
        self.error = error
        self.what = f"{obj.get('kind')} {where}{meta.get('name')}"
        super().__init__(f"applying {self.what} failed: {error.message}")


async def apply_children(
    kube: Kube,
    objects: Iterable[Mapping[str, Any]],
    after: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Apply in order; `after(kind)` runs after each (the test kill points hook in here)."""
    applied = []
    for obj in objects:
        try:
            applied.append(await kube.apply(obj, field_manager=c.FIELD_MANAGER))
        except ApiError as err:
            raise ApplyFailed(obj, err) from err
        if after is not None:
            after(str(obj["kind"]))
    return applied


def failure_status(failure: ApplyFailed) -> tuple[str, str, bool] | None:
    """(reason, message, permanent) for the network's status when a child cannot be
    applied; None for a failure worth retrying quietly (the apiserver, the network).
    A 403 is shown but retried: RBAC may be being fixed."""
    namespace = failure.obj["metadata"].get("namespace")
    status = failure.error.status
    if status == 404 and namespace:
        message = (
            f"the agent namespace {namespace!r} does not exist: create it (labelled "
            "pod-security.kubernetes.io/enforce=privileged; the chart does) or start the "
            "operator with --namespace set to an existing one"
        )
        return c.REASON_RENDER_FAILED, message, False
    if status in (400, 403, 422):
        return c.REASON_RENDER_FAILED, str(failure), status != 403
    return None
