"""Pod mutation (pure): what a pod annotated `metaroce.io/networks: a[,b...]` gets.

`mutate_pod(pod, networks, namespace)` returns `Allowed(patch, injected, warnings)` or
`Denied(message)`. The server only decodes the AdmissionReview and encodes the answer.

For each network named in the annotation (comma list, trimmed, deduplicated, order kept):
- the network must exist and be readable; its nodes' health is not admission's
  business (every agent-config rollout has no healthy node until the agents report
  again; the scheduler, the advertised resources and the taints keep pods off bad
  nodes), so only what is wrong with the pod or the network's existence is refused;
- the container NCCL runs in (the first container, or the one named by the annotation
  `metaroce.io/container`, which may be an init container) gets `requests` and `limits`
  of the network's resource = 1, unless some container (init containers included)
  already asks for that resource (then the pod's own numbers stand; a request without a
  limit gets the limit the apiserver requires, equal to it);
- the settings below go to each container that holds a unit of the network's resource
  (the one that gets the device), not to a fixed `containers[0]`: a prepended sidecar
  gets nothing;
- that container gets the capability `IPC_LOCK` (RDMA pins memory), unless the user
  explicitly drops it; a namespace whose Pod Security level (`enforce` label) is
  `baseline` or `restricted` forbids IPC_LOCK, so such a pod is refused with that reason;
- the network-wide NCCL variables listed in `spec.attachment.ncclEnv`:
  `NCCL_IB_TC` = the data DSCP as the whole ToS byte (dscp << 2),
  `NCCL_IB_QPS_PER_CONNECTION`, `NCCL_IB_TIMEOUT`, `NCCL_IB_RETRY_CNT` from
  `spec.transport`, `NCCL_SOCKET_IFNAME` = `spec.attachment.socketInterface` (if set),
  `NCCL_IB_GID_INDEX` when `spec.transport.roce.gidIndex` pins one. A variable the
  container already sets in `env` is never touched. `NCCL_IB_HCA` (and a GID index that
  is not pinned) depend on which NICs the container gets: the device plugin sets them.
  With several networks, the first one listed gives a variable's value (a warning says
  so when the others differ);
- a `metaroce` network injects instead the transport's network-wide variables
  (`metaroce_api.metaroce_env.network_env`: FI_PROVIDER, NCCL_NET_PLUGIN, MR_CONFIG;
  NCCL_SOCKET_IFNAME as above); the device plugin adds the library mount and the
  per-node part. A container whose own FI_PROVIDER or NCCL_NET_PLUGIN names something
  else keeps it and gets a warning that it will not use metaroce;
- the annotation `metaroce.io/injected` records what was injected (JSON).

Idempotent: mutating an already mutated pod changes nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaroce_api import MetaRoceNetwork
from metaroce_api.base import DNS_LABEL_RE
from metaroce_api.constants import CONTAINER_ANNOTATION, INJECTED_ANNOTATION, NETWORKS_ANNOTATION
from metaroce_api.metaroce_env import INTERFACE_ENV, SELECTING_ENV, interface_env
from metaroce_api.metaroce_env import network_env as metaroce_network_env
from metaroce_api.network import PodNetworkSpec
from metaroce_api.podnet import (
    MULTUS_NETWORKS_ANNOTATION,
    attachment_interface,
    malformed_list,
    merge_networks_annotation,
    nad_reference,
)

IPC_LOCK = "IPC_LOCK"
PSS_ENFORCE = "pod-security.kubernetes.io/enforce"
PSS_WARN = "pod-security.kubernetes.io/warn"
PSS_AUDIT = "pod-security.kubernetes.io/audit"
PSS_FORBIDS_IPC_LOCK = ("baseline", "restricted")
"""Pod Security Standards: baseline (and so restricted) allow only a fixed list of added
capabilities (AUDIT_WRITE, CHOWN, ... SYS_CHROOT); IPC_LOCK is not on it."""

NETWORK_ENV = (
    "NCCL_IB_TC",
    "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_GID_INDEX",
)
DEVICE_PLUGIN_ENV = ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX")

_NAME = re.compile(DNS_LABEL_RE)
DEFAULT_ATTACHMENT_NAMESPACE = "metaroce-system"
"""The agents' namespace by default, where the NetworkAttachmentDefinitions are."""


@dataclass(frozen=True)
class Namespace:
    """What the webhook knows about the pod's namespace (labels may be unknown)."""

    name: str
    labels: Mapping[str, str] | None = None


@dataclass(frozen=True)
class NetworkView:
    """A network as the webhook's cache holds it: the parsed model, or why it is unreadable."""

    name: str
    network: MetaRoceNetwork | None
    problem: str = ""

    @property
    def healthy_nodes(self) -> int:
        status = self.network.status if self.network else None
        return status.nodes.healthy if status and status.nodes else 0

    @property
    def desired_nodes(self) -> int:
        status = self.network.status if self.network else None
        return status.nodes.desired if status and status.nodes else 0


@dataclass(frozen=True)
class Allowed:
    patch: list[dict[str, Any]] = field(default_factory=list)
    injected: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Denied:
    message: str
    code: int = 403
    reason: str = "Forbidden"


Decision = Allowed | Denied


# --- JSON patch that creates missing parents -------------------------------------------------


def _escape(key: str | int) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _child(node: Any, key: str | int) -> Any:
    if isinstance(node, list):
        return node[int(key)]
    return node.get(key) if isinstance(node, dict) else None


def _clone(value: Any) -> Any:
    """A copy of plain JSON data (much cheaper than copy.deepcopy)."""
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


class _Patch:
    """Collects JSONPatch `add` ops against a working view of the pod, so later ops see
    earlier ones. The pod is never modified: nodes on a modified path are copied (shallow,
    once), the rest is shared."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc: dict[str, Any] = dict(doc)
        self._owned = {id(self.doc)}
        self.ops: list[dict[str, Any]] = []

    def _own(self, parent: Any, key: str | int) -> Any:
        """parent[key], copied first unless this patch made it."""
        index: Any = int(key) if isinstance(parent, list) else key
        child = parent[index]
        if id(child) in self._owned or not isinstance(child, dict | list):
            return child
        mine = dict(child) if isinstance(child, dict) else list(child)
        parent[index] = mine
        self._owned.add(id(mine))
        return mine

    def _add(self, path: Sequence[str | int], value: Any) -> None:
        self.ops.append(
            {"op": "add", "path": "/" + "/".join(_escape(p) for p in path), "value": _clone(value)}
        )
        node: Any = self.doc
        for key in path[:-1]:
            node = self._own(node, key)
        last = path[-1]
        fresh = _clone(value)
        if isinstance(fresh, dict | list):
            self._owned.add(id(fresh))
        if last == "-":
            node.append(fresh)
        else:
            node[last] = fresh

    def set(self, path: Sequence[str | int], value: Any) -> None:
        """Set `path` to `value`, creating missing (or null) parent objects on the way."""
        node: Any = self.doc
        for depth, key in enumerate(path[:-1]):
            child = _child(node, key)
            if child is None:
                nested = value
                for k in reversed(path[depth + 1 :]):
                    nested = {k: nested}
                self._add(path[: depth + 1], nested)
                return
            node = child
        self._add(path, value)

    def merge(self, path: Sequence[str | int], value: Mapping[str, Any]) -> None:
        """Add the keys of `value` under the object at `path` (recursively), with as few ops
        as possible: a missing object is added whole."""
        node: Any = self.doc
        for key in path:
            node = _child(node, key)
            if node is None:
                self.set(path, dict(value))
                return
        if node == {}:
            # One op for the whole object (the apiserver sends `resources: {}`): the
            # apiserver pays per op and per byte when it applies the patch.
            self._add(path, dict(value))
            return
        for key, item in value.items():
            if isinstance(item, Mapping) and isinstance(node.get(key), dict):
                self.merge([*path, key], item)
            elif key not in node or node.get(key) is None:
                self._add([*path, key], item)

    def extend(self, path: Sequence[str | int], items: Sequence[Any]) -> None:
        """Append `items` to the list at `path` (one op creates it when missing)."""
        if not items:
            return
        node: Any = self.doc
        for key in path:
            node = _child(node, key)
            if node is None:
                self.set(path, list(items))
                return
        for item in items:
            self._add([*path, "-"], item)

    def append(self, path: Sequence[str | int], item: Any) -> None:
        """Append to the list at `path`, creating it when missing."""
        node: Any = self.doc
        for key in path:
            node = _child(node, key)
            if node is None:
                break
        if node is None:
            self.set(path, [item])
        else:
            self._add([*path, "-"], item)


# --- helpers ----------------------------------------------------------------------------------


def parse_networks_annotation(value: str) -> tuple[list[str], str | None]:
    """(names, error): the comma list trimmed and deduplicated, or what is wrong with it."""
    names = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    if not names:
        return [], (
            f"annotation {NETWORKS_ANNOTATION} is {value!r} and names no network: write "
            f"{NETWORKS_ANNOTATION}: <network>[,<network>...], or remove the annotation"
        )
    bad = [n for n in names if len(n) > 63 or not _NAME.match(n)]
    if bad:
        return [], (
            f"annotation {NETWORKS_ANNOTATION}: {', '.join(repr(b) for b in bad)} is not a "
            "network name (lowercase letters, digits and '-', at most 63): write the names "
            f"of MetaRoceNetworks separated by commas, e.g. {NETWORKS_ANNOTATION}: backend"
        )
    return names, None


def _existing(networks: Mapping[str, NetworkView]) -> str:
    if not networks:
        return "no MetaRoceNetwork exists yet: create one first (kubectl get metarocenetworks)"
    ready = sorted(n for n, v in networks.items() if v.healthy_nodes > 0)
    others = sorted(n for n in networks if n not in ready)
    text = "existing networks: " + (", ".join(ready) + " (ready)" if ready else "")
    if others:
        text += ("; " if ready else "") + ", ".join(others) + " (no ready node)"
    return text


def _pod_label(pod: Mapping[str, Any], namespace: str) -> str:
    meta = pod.get("metadata") or {}
    name = meta.get("name") or (meta.get("generateName", "") + "*")
    return f"pod {namespace}/{name}"


def pod_attachment(net: MetaRoceNetwork) -> PodNetworkSpec | None:
    """The network's podNetwork when its pods get a Multus secondary interface."""
    pod_network = net.spec.attachment.pod_network
    if net.spec.transport.mode != "metaroce" or pod_network is None or not pod_network.secondary:
        return None
    return pod_network


def network_env(net: MetaRoceNetwork, host_network: bool = False) -> dict[str, str]:
    """The network-wide NCCL variables of `net`, limited to its `ncclEnv` (a metaroce
    network: the transport's variables, and NCCL_SOCKET_IFNAME when listed and set; with
    a Multus secondary interface and a pod not on the host network, the interface the
    transport binds: `FI_METAROCE_IFACE` and `MR_NCCL_IFNAME`, which the device plugin
    otherwise sets to the node's netdev, as it does for hostNetwork pods)."""
    spec = net.spec
    wanted = set(spec.attachment.nccl_env)
    if spec.transport.mode == "metaroce":
        env = metaroce_network_env(spec.transport, spec.qos)
        if "NCCL_SOCKET_IFNAME" in wanted and spec.attachment.socket_interface:
            env["NCCL_SOCKET_IFNAME"] = spec.attachment.socket_interface
        pod_network = pod_attachment(net)
        if pod_network is not None and not host_network:
            env.update(interface_env(pod_network.interface))
        return env
    values: dict[str, str | None] = {
        "NCCL_IB_TC": str(spec.qos.data.dscp << 2),
        "NCCL_IB_QPS_PER_CONNECTION": str(spec.transport.qps_per_connection),
        "NCCL_IB_TIMEOUT": str(spec.transport.ack_timeout),
        "NCCL_IB_RETRY_CNT": str(spec.transport.retry_count),
        "NCCL_SOCKET_IFNAME": spec.attachment.socket_interface,
        "NCCL_IB_GID_INDEX": (
            str(spec.transport.roce.gid_index)
            if spec.transport.roce.gid_index is not None
            else None
        ),
    }
    return {k: v for k in NETWORK_ENV if k in wanted and (v := values[k]) is not None}


def _pss_level(labels: Mapping[str, str] | None, key: str) -> str | None:
    if not labels:
        return None
    level = labels.get(key)
    return level if level in PSS_FORBIDS_IPC_LOCK else None


def _has_resource(container: Mapping[str, Any], resource: str) -> bool:
    res = container.get("resources") or {}
    return resource in (res.get("requests") or {}) or resource in (res.get("limits") or {})


# --- the mutation ---------------------------------------------------------------------------------


def mutate_pod(
    pod: Mapping[str, Any],
    networks: Mapping[str, NetworkView],
    namespace: Namespace,
    *,
    check_pod_security: bool = True,
    default_pod_security: str = "privileged",
    attachment_namespace: str = DEFAULT_ATTACHMENT_NAMESPACE,
) -> Decision:
    """Decide on one pod CREATE; see the module docstring.

    `attachment_namespace`: where the networks' NetworkAttachmentDefinitions are (the
    agents' namespace).

    `default_pod_security`: the cluster's PodSecurity default `enforce` level (from its
    AdmissionConfiguration), used for namespaces without the label."""
    meta = pod.get("metadata") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    raw = annotations.get(NETWORKS_ANNOTATION)
    if raw is None:
        return Allowed()
    who = _pod_label(pod, namespace.name)
    names, error = parse_networks_annotation(raw)
    if error:
        return Denied(f"{who}: {error}")

    views: list[NetworkView] = []
    for name in names:
        view = networks.get(name)
        if view is None:
            return Denied(
                f"{who}: network {name!r} (annotation {NETWORKS_ANNOTATION}) does not exist; "
                f"{_existing(networks)}"
            )
        if view.network is None:
            return Denied(
                f"{who}: network {name!r} cannot be read by this operator: {view.problem}; "
                "fix the MetaRoceNetwork or upgrade the operator"
            )
        views.append(view)

    spec = pod.get("spec") or {}
    slots = _containers(spec)
    if not any(slot.kind == "containers" for slot in slots):
        return Denied(f"{who}: the pod has no containers to attach network(s) to")
    wanted_container = annotations.get(CONTAINER_ANNOTATION)
    if wanted_container is not None:
        named = [slot for slot in slots if slot.name == wanted_container]
        if not named:
            names_in_pod = [slot.name for slot in slots]
            return Denied(
                f"{who}: annotation {CONTAINER_ANNOTATION} names container "
                f"{wanted_container!r}, which the pod does not have; its containers are "
                f"{', '.join(repr(n) for n in names_in_pod)}: name one of them, or remove the "
                "annotation to use the first"
            )
        default = named[0]
    else:
        default = slots[0]

    warnings: list[str] = []
    labels = namespace.labels
    if labels is not None and PSS_ENFORCE not in labels:
        labels = {**labels, PSS_ENFORCE: default_pod_security}
    enforce = _pss_level(labels, PSS_ENFORCE)
    if check_pod_security and enforce:
        where = (
            f"label {PSS_ENFORCE}={enforce}"
            if namespace.labels and PSS_ENFORCE in namespace.labels
            else "the cluster's default level; the namespace has no label"
        )
        return Denied(
            f"{who}: namespace {namespace.name!r} enforces the Pod Security level "
            f"{enforce!r} ({where}), which forbids the capability "
            f"{IPC_LOCK} that RDMA needs to pin memory, so the pod would be refused anyway: "
            f"run it in a namespace labelled {PSS_ENFORCE}=privileged, or have the cluster "
            "admin exempt this namespace"
        )
    for key in (PSS_WARN, PSS_AUDIT):
        level = _pss_level(namespace.labels, key)
        if level:
            warnings.append(
                f"namespace {namespace.name!r} has {key}={level}: {IPC_LOCK}, which metaroce "
                "adds for RDMA, violates that level"
            )

    patch = _Patch(pod)
    injected: dict[str, Any] = {"networks": names}
    host_network = bool(spec.get("hostNetwork"))
    attachments = _attach(patch, annotations, views, attachment_namespace, host_network, warnings)
    if attachments:
        injected["attachments"] = attachments

    # Resources: one unit (= one NIC) of each network, unless a container (init ones
    # included) asks already. The settings below go to the containers that hold a unit.
    resources: dict[str, str] = {}
    wanted: dict[str, str] = {}
    served: dict[_Slot, list[NetworkView]] = {}
    for view in views:
        assert view.network is not None
        resource = view.network.resource_name
        owners = [slot for slot in slots if _has_resource(slot.body, resource)]
        for owner in owners:
            res = owner.body.get("resources") or {}
            requests = res.get("requests") or {}
            limits = res.get("limits") or {}
            if resource in requests and resource not in limits:
                patch.set([*owner.path, "resources", "limits", resource], requests[resource])
                resources[resource] = str(requests[resource])
        if not owners:
            wanted[resource] = "1"
            resources[resource] = "1"
            owners = [default]
        for owner in owners:
            served.setdefault(owner, []).append(view)
    if wanted:
        patch.merge(
            [*default.path, "resources"], {"requests": dict(wanted), "limits": dict(wanted)}
        )
    if resources:
        injected["resources"] = resources

    targets = list(served)
    injected["container"] = targets[0].name
    records = [_settle(patch, slot, served[slot], warnings, host_network) for slot in targets]
    if len(targets) == 1:
        injected.update(records[0])
    else:
        injected["containers"] = {
            slot.name: rec for slot, rec in zip(targets, records, strict=True)
        }
    network_keys = {k for v in views if v.network for k in network_env(v.network, host_network)}
    plugin_env = sorted(
        {
            k
            for v in views
            if v.network and v.network.spec.transport.mode != "metaroce"
            for k in v.network.spec.attachment.nccl_env
        }
        & set(DEVICE_PLUGIN_ENV) - network_keys
    )
    if plugin_env:
        injected["devicePluginEnv"] = plugin_env
    if len(views) > 1 and "NCCL_IB_HCA" in plugin_env:
        warnings.append(
            f"the pod asks for {len(views)} networks: each network's device plugin sets "
            "NCCL_IB_HCA to its own NICs, and only one value reaches the container; set "
            "NCCL_IB_HCA in env (e.g. from the devices in the pod's resources) to use all"
        )

    if not patch.ops:
        return Allowed(warnings=warnings)  # already mutated (or nothing to add): idempotent
    summary = json.dumps(injected, sort_keys=True, separators=(",", ":"))
    patch.set(["metadata", "annotations", INJECTED_ANNOTATION], summary)
    return Allowed(patch=patch.ops, injected=injected, warnings=warnings)


@dataclass(frozen=True, eq=False)
class _Slot:
    """One container of the pod (regular or init) and where it is in the pod."""

    kind: str
    """`containers` or `initContainers`."""
    index: int
    body: Mapping[str, Any]
    name: str

    @property
    def path(self) -> list[str | int]:
        return ["spec", self.kind, self.index]


def _containers(spec: Mapping[str, Any]) -> list[_Slot]:
    """Regular containers first (the default target is the first of them), then init
    containers (a native sidecar or a setup step may hold the device)."""
    out: list[_Slot] = []
    for kind in ("containers", "initContainers"):
        for index, body in enumerate(spec.get(kind) or []):
            if isinstance(body, Mapping):
                out.append(_Slot(kind, index, body, str(body.get("name") or f"#{index}")))
    return out


def _attach(
    patch: _Patch,
    annotations: Mapping[str, str],
    views: Sequence[NetworkView],
    namespace: str,
    host_network: bool,
    warnings: list[str],
) -> list[str]:
    """The Multus attachment of each network with a secondary pod interface, into the
    pod's `k8s.v1.cni.cncf.io/networks` (kept as the user wrote it where it lists the
    network's NAD already; see metaroce_api.podnet). None for hostNetwork pods: Multus
    attaches nothing to them, and the transport binds the node's netdev."""
    value = annotations.get(MULTUS_NETWORKS_ANNOTATION)
    added: list[str] = []
    for view in views:
        assert view.network is not None
        declared = view.network.spec.attachment.pod_network
        if declared is not None and not declared.secondary and not host_network:
            warnings.append(
                f"network {view.name!r} has spec.attachment.podNetwork.mode hostNetwork but "
                "the pod does not run with hostNetwork: true, so the transport binds the "
                "pod's own interface of that name, not the node's netdev: set hostNetwork"
            )
        pod_network = pod_attachment(view.network)
        if pod_network is None or host_network:
            continue
        if malformed_list((value or "").strip()):
            warnings.append(
                f"annotation {MULTUS_NETWORKS_ANNOTATION} starts a JSON list it does not end: "
                f"the attachment of network {view.name!r} is not added (Multus will refuse the "
                "pod); fix the annotation"
            )
            continue
        merged = merge_networks_annotation(value, namespace, view.name, pod_network.interface)
        if merged is None:
            iface = attachment_interface(value, namespace, view.name)
            if iface != pod_network.interface:
                warnings.append(
                    f"annotation {MULTUS_NETWORKS_ANNOTATION} attaches network {view.name!r} "
                    f"as interface {iface or '(unnamed: Multus calls it netN)'}, but the "
                    f"transport is pointed at {pod_network.interface!r} "
                    "(spec.attachment.podNetwork.interface): name it "
                    f"{nad_reference(namespace, view.name, pod_network.interface)}, or remove "
                    "the entry and let metaroce add it"
                )
            continue
        value = merged
        added.append(nad_reference(namespace, view.name, pod_network.interface))
    if added:
        patch.set(["metadata", "annotations", MULTUS_NETWORKS_ANNOTATION], value)
    return added


def _settle(
    patch: _Patch,
    slot: _Slot,
    views: Sequence[NetworkView],
    warnings: list[str],
    host_network: bool = False,
) -> dict[str, Any]:
    """IPC_LOCK and the network-wide NCCL variables for one container that holds units of
    `views` (the first network listed wins a variable; the user's own env is never
    touched). Returns what was injected into it."""
    record: dict[str, Any] = {}
    cname = slot.name
    caps = (slot.body.get("securityContext") or {}).get("capabilities") or {}
    added = caps.get("add") or []
    dropped = caps.get("drop") or []
    if IPC_LOCK in dropped:
        warnings.append(
            f"container {cname!r} drops {IPC_LOCK}: left as written, but RDMA memory "
            "registration will fail unless the memlock limit is raised some other way"
        )
    elif IPC_LOCK not in added:
        patch.append([*slot.path, "securityContext", "capabilities", "add"], IPC_LOCK)
        record["capabilities"] = [IPC_LOCK]

    user_env = {e.get("name") for e in slot.body.get("env") or [] if isinstance(e, Mapping)}
    env: dict[str, str] = {}
    origin: dict[str, str] = {}
    for view in views:
        assert view.network is not None
        for key, value in network_env(view.network, host_network).items():
            if key not in env:
                env[key], origin[key] = value, view.name
            elif env[key] != value:
                warnings.append(
                    f"{key}: networks {origin[key]!r} and {view.name!r} want different values "
                    f"({env[key]} and {value}); {origin[key]!r} (listed first) wins"
                )
    kept = sorted(k for k in env if k in user_env)
    user_values = {
        e.get("name"): e.get("value") for e in slot.body.get("env") or [] if isinstance(e, Mapping)
    }
    for key in kept:
        if key in INTERFACE_ENV and user_values.get(key) != env[key]:
            warnings.append(
                f"container {cname!r} sets {key}={user_values.get(key)!r}: kept, so the "
                f"transport of network {origin[key]!r} binds that interface, not its "
                f"secondary interface on the data NIC ({env[key]!r}); remove {key} from its "
                "env to use it"
            )
        elif key in SELECTING_ENV and user_values.get(key) != env[key]:
            warnings.append(
                f"container {cname!r} sets {key}={user_values.get(key)!r}: kept, so it will "
                f"not use the metaroce transport of network {origin[key]!r}; remove {key} "
                "from its env to use it"
            )
    added_env = {k: v for k, v in env.items() if k not in user_env}
    patch.extend([*slot.path, "env"], [{"name": k, "value": v} for k, v in added_env.items()])
    if added_env:
        record["env"] = added_env
    if kept:
        record["keptUserEnv"] = kept
    if slot.body.get("envFrom") and added_env:
        warnings.append(
            f"container {cname!r} uses envFrom: the NCCL variables metaroce sets in env "
            f"({', '.join(sorted(added_env))}) take precedence over it; set them in env to "
            "choose other values"
        )
    return record
