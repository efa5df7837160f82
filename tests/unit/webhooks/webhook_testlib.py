"""Builders for the webhook unit tests: networks (with status) and pods as API dicts."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch  # type: ignore[import-untyped]

from metaroce_api import validate_network
from metaroce_api.examples import minimal_network
from metaroce_operator.webhooks.mutate import NetworkView


def deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def network_obj(
    name: str, healthy: int | None = 2, desired: int = 3, **spec: Any
) -> dict[str, Any]:
    obj = minimal_network(name)
    if "nics" in spec:
        obj["spec"].pop("nics")  # a test's nics replace the example's, not add to them
    obj["spec"] = deep_merge(obj["spec"], spec)
    if healthy is not None:
        obj["status"] = {
            "nodes": {"desired": desired, "configured": healthy, "healthy": healthy, "failed": 0}
        }
    return obj


def view(name: str, healthy: int | None = 2, desired: int = 3, **spec: Any) -> NetworkView:
    return NetworkView(name, validate_network(network_obj(name, healthy, desired, **spec)))


def views(*items: NetworkView) -> dict[str, NetworkView]:
    return {v.name: v for v in items}


def pod(
    networks: str | None = "backend",
    *,
    containers: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    ann = dict(annotations or {})
    if networks is not None:
        ann["metaroce.io/networks"] = networks
    meta: dict[str, Any] = {"name": "trainer-0", "namespace": "jobs"}
    if ann:
        meta["annotations"] = ann
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": containers or [{"name": "main", "image": "example.com/train:1"}]},
    }


def apply_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply a JSONPatch the way the apiserver does (RFC 6902)."""
    result: dict[str, Any] = jsonpatch.apply_patch(obj, ops)
    return result
