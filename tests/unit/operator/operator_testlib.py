"""Builders shared by the operator's unit tests (imported by name: tests have no packages)."""

from __future__ import annotations

import copy
from typing import Any

from metaroce_api import MetaRoceNetwork, validate_network
from metaroce_api.examples import merge, minimal_network


def network(
    name: str = "net", generation: int = 1, uid: str = "uid-1", **spec: Any
) -> MetaRoceNetwork:
    body = minimal_network(name)
    body["metadata"].update({"generation": generation, "uid": uid})
    return validate_network(merge(body, {"spec": spec}))


def network_body(name: str = "net", generation: int = 1, **spec: Any) -> dict[str, Any]:
    body = minimal_network(name)
    body["metadata"].update({"generation": generation, "uid": f"uid-{name}"})
    return copy.deepcopy(merge(body, {"spec": spec}))
