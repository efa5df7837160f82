"""Example objects: the smallest valid network and NodeState, and the deep merge that turns
them into the rule examples (`Rule.rejects` / `Rule.accepts`).

Tests, docs and the demo start from these, so a change to what is required shows up in
one place.
"""

import copy
from collections.abc import Mapping
from typing import Any

from metaroce_api.base import Case, Rule
from metaroce_api.constants import API_VERSION, NETWORK_KIND, NODESTATE_KIND
from metaroce_api.nodestate import nodestate_labels, nodestate_name


def minimal_network(name: str = "example") -> dict[str, Any]:
    """The smallest valid MetaRoceNetwork: every other field has a default."""
    return {
        "apiVersion": API_VERSION,
        "kind": NETWORK_KIND,
        "metadata": {"name": name},
        "spec": {"nics": {"interfaceNames": ["eth1"]}},
    }


def full_network(name: str = "example") -> dict[str, Any]:
    """A network with most fields written out: classic RoCEv2 on ConnectX NICs of GPU nodes."""
    return {
        "apiVersion": API_VERSION,
        "kind": NETWORK_KIND,
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {
                "matchLabels": {"nvidia.com/gpu.present": "true"},
                "matchExpressions": [
                    {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"}
                ],
            },
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "nics": {
                "interfaceNames": ["ens*f0np0", "ens*f1np1"],
                "pciVendorIds": ["0x15b3"],
                "pciDeviceIds": ["0x101d", "0x1021"],
                "drivers": ["mlx5_core"],
                "rdmaDevices": ["mlx5_*"],
                "allowPrimaryInterface": False,
            },
            "transport": {
                "mode": "rocev2",
                "mtu": 9000,
                "roce": {"version": 2, "addressFamily": "ipv4"},
                "qpsPerConnection": 4,
                "ackTimeout": 20,
                "retryCount": 7,
                "allowSoftRoceFallback": False,
            },
            "qos": {
                "profile": "lossless",
                "data": {"dscp": 26, "priority": 3},
                "cnp": {"dscp": 48, "priority": 6},
                "pfcPriorities": [3],
                "ets": [
                    {"priority": 3, "bandwidthPercent": 60},
                    {"priority": 0, "bandwidthPercent": 40},
                ],
                "ecn": True,
                "onUnsupported": "error",
            },
            "attachment": {
                "resourceName": "example.com/rdma",
                "podsPerDevice": 1,
                "ncclEnv": [
                    "NCCL_IB_HCA",
                    "NCCL_IB_GID_INDEX",
                    "NCCL_IB_TC",
                    "NCCL_IB_QPS_PER_CONNECTION",
                    "NCCL_SOCKET_IFNAME",
                ],
                "socketInterface": "eth0",
            },
            "health": {
                "probe": {
                    "enabled": True,
                    "peersPerNode": 3,
                    "interval": "30s",
                    "maxLatencyMicroseconds": 200,
                    "maxLossFraction": 0.001,
                },
                "action": "taint",
                "maxTaintedFraction": 0.05,
                "readyFraction": 0.9,
            },
            "agent": {
                "image": "registry.example.com/metaroce/agent:0.1.0",
                "resources": {
                    "requests": {"cpu": "100m", "memory": "128Mi"},
                    "limits": {"memory": "512Mi"},
                },
                "updateStrategy": {"maxUnavailable": "10%", "paused": False, "maxHold": "24h"},
                "logLevel": "info",
                "driftInterval": "5m",
                "metricsPort": 9478,
                "probePort": 47911,
            },
            "cleanupOnDelete": True,
        },
    }


def minimal_nodestate(network: str = "example", node: str = "node-a") -> dict[str, Any]:
    """The smallest valid MetaRoceNodeState, named and labelled as the agent does."""
    return {
        "apiVersion": API_VERSION,
        "kind": NODESTATE_KIND,
        "metadata": {
            "name": nodestate_name(network, node),
            "labels": nodestate_labels(network, node),
        },
        "spec": {"network": network, "node": node},
    }


def minimal_object(kind: str, name: str) -> dict[str, Any]:
    """The minimal object of `kind`; for a NodeState `name` is the network's."""
    if kind == NETWORK_KIND:
        return minimal_network(name)
    if kind == NODESTATE_KIND:
        return minimal_nodestate(network=name)
    raise ValueError(f"no example for kind {kind!r}")


def merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: maps merge, anything else replaces, and `None` deletes the key."""
    out = copy.deepcopy(dict(base))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def case_objects(rule: Rule, case: Case, name: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(object to create first or None, object to submit) for one example of `rule`."""
    base = minimal_object(rule.kind, name)
    if rule.is_update_rule:
        before = merge(base, case.before or {})
        return before, merge(before, case.patch)
    return None, merge(base, case.patch)
