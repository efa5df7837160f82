"""The node's CNI configuration of a metaroce network's NetworkAttachmentDefinition.

With `spec.attachment.podNetwork` mode macvlan or ipvlan, the operator renders the
network's NAD without `spec.config`, and Multus reads the configuration from its
`confDir` (`/etc/cni/multus/net.d`): the file whose `name` is the NAD's name (see
`metaroce_api.podnet`). This agent writes that file for its node: the master is the
network's first selected netdev (the one the transport binds, as `FI_METAROCE_IFACE`
on hostNetwork pods), the addresses come from the node's block of the subnet, which the
operator records in the node annotation `podnet.metaroce.io/<network>`.

One step (`MultusConfStep`): apply writes the file atomically (a CNI ADD that reads it
meanwhile sees the old or the new one, never half of it), verify reads it back, undo
removes it, or puts back what was there before the agent (a file of that name it did
not write). Pods already attached keep their interface and address when it goes:
Multus reads it only on pod creation (and on deletion, for host-local's release).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from metaroce_agent.host import Host, HostError
from metaroce_agent.steps import Json, Step, StepError
from metaroce_api import AgentConfig
from metaroce_api.podnet import block_annotation, cni_config, cni_config_text, conf_path


@dataclass(frozen=True)
class MultusConfStep(Step):
    kind = "multus-conf"
    knob = "pod-network"
    method = "file"
    snapshot_is_state = True

    path: str = ""
    content: str = ""

    def id_suffix(self) -> str:
        return f":{self.path}"

    @property
    def name(self) -> str:
        return f"{self.knob} {self.path}"

    def value(self) -> str:
        try:
            conf = json.loads(self.content)
            ipam = conf["ipam"]["ranges"][0][0]
            return (
                f"{conf['type']} on {conf['master']}, {ipam['rangeStart']}-{ipam['rangeEnd']} "
                f"of {ipam['subnet']}"
            )
        except (ValueError, KeyError, IndexError, TypeError):
            return self.path

    def snapshot(self, host: Host) -> Json:
        return host.read_opt(self.path)

    def apply(self, host: Host) -> None:
        if host.read_opt(self.path) == self.content.strip():
            return
        try:
            host.write_atomic(self.path, self.content)
        except HostError as e:
            raise StepError(f"cannot write the pod network's CNI configuration: {e}") from e

    def verify(self, host: Host) -> str | None:
        got = host.read_opt(self.path)  # stripped
        if got == self.content.strip():
            return None
        if got is None:
            return f"{self.path} is missing"
        return f"{self.path} differs from the network's CNI configuration"

    def undo(self, host: Host, snapshot: Json) -> None:
        try:
            if isinstance(snapshot, str):
                host.write_atomic(self.path, snapshot)
            else:
                host.remove(self.path)
        except HostError as e:
            raise StepError(f"cannot undo the pod network's CNI configuration: {e}") from e


def multus_conf_step(config: AgentConfig, master: str, block: str) -> MultusConfStep:
    """The step for this node (`block`: the node annotation's value)."""
    spec = config.pod_network
    assert spec is not None
    conf = cni_config(config.network, spec, master, block)
    return MultusConfStep(master, path=conf_path(config.network), content=cni_config_text(conf))


def missing_block_message(network: str) -> str:
    return (
        f"this node has no block of spec.attachment.podNetwork.subnet yet (node annotation "
        f"{block_annotation(network)}, which the operator sets for every node of the network): "
        "wait for the operator; if it stays missing, the network's Degraded condition says why "
        "(e.g. a subnet too small for the nodes)"
    )
