"""A fake node whose state survives kill -9: the unit tier's fixture tree and fake
kernel (tests/unit/agent/fakes.py), with the kernel's tables (DCB APP, PFC, ETS, qdiscs,
tc filters) saved to a JSON file after every command that changes them.

The sysfs/configfs side (MTU, rdma_cm ToS, rxe devices) already lives in files under the
tree's root. A failpoint's SIGKILL lands between two Python statements, never inside a
save, so the files always hold what the last command did, as the kernel would.
Used by the agent process (fault_driver.py) and by the tests that read the node after it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "agent"))

from fakes import FakeKernel, FixtureHost, SysfsTree, mellanox_node, softroce_node

from metaroce_agent.host import CommandResult
from metaroce_api import AgentConfig
from metaroce_api.failpoints import failpoint

STATE_FILE = "kernel.json"
"""The kernel's tables, beside the tree's root."""
COMMANDS_FILE = "commands.log"
"""Every state-changing command any agent process ran on the node, one per line."""
READ_ONLY = (" show", " -V", "modprobe -n")
NODE_CHANGED = "node.after_change"
"""The fake node's failpoint: after each command that changes it, each file written."""


class PersistentTree(SysfsTree):
    """A tree that already exists: a new uverbs device takes the lowest free index, as the
    kernel's ida does (the in-memory counter of `SysfsTree` starts at 0 in every process)."""

    def rdma(self, name: str, **kw: Any) -> None:
        used = set(os.listdir(self.p("/sys/class/infiniband_verbs")))
        self._uverbs = next(i for i in range(1000) if f"uverbs{i}" not in used)
        super().rdma(name, **kw)


class PersistentKernel(FakeKernel):
    """`FakeKernel` whose tables are loaded from and saved to `<dir>/kernel.json`."""

    def __init__(self, tree: SysfsTree, directory: Path, **kw: Any) -> None:
        super().__init__(tree, **kw)
        self.directory = directory

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0
    ) -> CommandResult:
        joined = " ".join(str(a) for a in argv)
        mutating = not any(r in joined for r in READ_ONLY)
        try:
            return super().run(argv, check=check, timeout=timeout)
        finally:
            if mutating:
                self.save()
                with open(self.directory / COMMANDS_FILE, "a", encoding="utf-8") as log:
                    log.write(joined + "\n")
                failpoint(NODE_CHANGED)

    def tables(self) -> dict[str, Any]:
        return {
            "dcb_devices": sorted(self.dcb_devices),
            "dscp_prio": {d: sorted(map(list, s)) for d, s in sorted(self.dscp_prio.items()) if s},
            "pfc": dict(sorted(self.pfc.items())),
            "ets": dict(sorted(self.ets.items())),
            "qdiscs": {d: sorted(q) for d, q in sorted(self.qdiscs.items()) if q},
            "tc_filters": {
                f"{dev}|{direction}": {str(pref): f for pref, f in sorted(table.items())}
                for (dev, direction), table in sorted(self.tc_filters.items())
                if table
            },
        }

    def save(self) -> None:
        path = self.directory / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.tables(), indent=1, sort_keys=True))
        os.replace(tmp, path)

    @classmethod
    def load(cls, root: Path) -> PersistentKernel:
        directory = root.parent
        data = json.loads((directory / STATE_FILE).read_text())
        kernel = cls(PersistentTree(root), directory, dcb_devices=set(data["dcb_devices"]))
        kernel.dscp_prio = {
            d: {(int(a), int(b)) for a, b in s} for d, s in data["dscp_prio"].items()
        }
        kernel.pfc = {d: list(v) for d, v in data["pfc"].items()}
        kernel.ets = {d: dict(v) for d, v in data["ets"].items()}
        kernel.qdiscs = {d: set(q) for d, q in data["qdiscs"].items()}
        kernel.tc_filters = {
            (key.split("|")[0], key.split("|")[1]): {int(p): f for p, f in table.items()}
            for key, table in data["tc_filters"].items()
        }
        return kernel


class FaultHost(FixtureHost):
    """`FixtureHost` with the failpoint `node.after_change` after every change to the
    node's files (sysfs, configfs; not the agent's own state), as after every command:
    a kill can land inside a step made of several changes."""

    def _changed(self, path: str) -> None:
        if not path.startswith("/run/metaroce"):
            failpoint(NODE_CHANGED)

    def write(self, path: str, value: str) -> None:
        super().write(path, value)
        self._changed(path)

    def mkdir(self, path: str) -> None:
        super().mkdir(path)
        self._changed(path)

    def rmdir(self, path: str) -> None:
        super().rmdir(path)
        self._changed(path)


def host_for(root: Path) -> FixtureHost:
    """The node at `root` as the agent sees it (a fresh process: state from the files)."""
    return FaultHost(root, runner=PersistentKernel.load(root))


# --- the nodes and configs the tier uses -----------------------------------------------


def build_node(profile: str, root: Path) -> None:
    """Make the pre-agent node `profile` (softroce: a guest with a virtio NIC and no RDMA
    device; mellanox: a ConnectX port with DCB and ECN knobs) under `root`."""
    case = {"softroce": softroce_node, "mellanox": mellanox_node}[profile]
    tree, kernel = case(root)
    if profile == "mellanox":  # a node whose PFC was not off before the agent
        kernel.pfc["ens1f0"] = [False, False, False, False, True, False, False, False]
    persistent = PersistentKernel(tree, root.parent, dcb_devices=kernel.dcb_devices)
    persistent.pfc, persistent.dscp_prio = kernel.pfc, kernel.dscp_prio
    persistent.save()


def config(profile: str, which: str) -> AgentConfig:
    """Config `a` (the first the node verifies) or `b` (a change of DSCP, priority and
    MTU: most steps change, one DCB entry goes and one comes) of `profile`."""
    data: dict[str, Any] = {
        "network": "rdma-a",
        "generation": 3 if which == "a" else 4,
        "resourceName": "metaroce.io/rdma-a",
    }
    if profile == "softroce":
        data["nics"] = {"interfaceNames": ["eth0"]}
        data["transport"] = {"mode": "softroce", "mtu": 1400 if which == "a" else 1300}
    else:
        data["nics"] = {"interfaceNames": ["ens1f0"]}
        data["transport"] = {"mode": "rocev2", "mtu": 4200 if which == "a" else 4000}
    if which == "b":
        data["qos"] = {"data": {"dscp": 34, "priority": 4}}
    return AgentConfig.model_validate(data)


def host_state(root: Path) -> dict[str, Any]:
    """Everything on the node but the agent's own state: every file of the tree (its
    content, or where a link points) and the kernel's tables."""
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.startswith(os.path.join("run", "metaroce")):
            continue
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, root)
            if os.path.islink(path):
                files[key] = "-> " + os.readlink(path)
            elif os.path.isfile(path):
                files[key] = Path(path).read_text().strip()  # as sysfs reads go
            elif not key.startswith(os.path.join("run", "metaroce")):
                files[key] = "<dir>"
    kernel = json.loads((root.parent / STATE_FILE).read_text())
    return {"files": files, "kernel": kernel}
