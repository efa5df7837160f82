"""The agent's `metaroce` driver: its plan, the versioned library directory (installed from
the real built transport and verified by the real self-test), and tc marking of the
network's port range."""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config
from fakes import FakeKernel, FixtureHost, mellanox_node, softroce_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.host import CommandResult, SubprocessRunner
from metaroce_agent.plan import make_plan
from metaroce_agent.qos.dcb import DcbAppStep, DcbPfcStep
from metaroce_agent.qos.tcmark import ClsactStep, TcPortRangeMarkStep
from metaroce_agent.report import transport_state
from metaroce_agent.transport.library import (
    FILES,
    HOST_ROOT,
    MetaRoceLibraryStep,
    check_installed,
    mapped_by,
    read_bundle,
)
from metaroce_agent.transport.select import driver_for
from metaroce_agent.transport.softroce import SoftRoceDriver

REPO = Path(__file__).resolve().parents[3]
METAROCE = {"mode": "metaroce", "metaroce": {"portRange": {"first": 21000, "last": 21999}}}
LOSSY = {"profile": "lossy"}


@dataclass
class RealSelfTest:
    """FakeKernel for the node's tools; the self-test (python -m ...) really runs."""

    kernel: FakeKernel
    real: SubprocessRunner

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0
    ) -> CommandResult:
        if argv and argv[0] == sys.executable:
            return self.real.run(argv, check=check, timeout=timeout)
        return self.kernel.run(argv, check=check, timeout=timeout)


@dataclass
class CountingSelfTest(RealSelfTest):
    """RealSelfTest that counts the self-tests it ran."""

    self_tests: int = 0

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0
    ) -> CommandResult:
        if "metaroce_agent.transport.selftest" in argv:
            self.self_tests += 1
        return super().run(argv, check=check, timeout=timeout)


def _host(n: Any) -> FixtureHost:
    return FixtureHost(n.tree.root, runner=RealSelfTest(n.kernel, SubprocessRunner()))


def test_plan_without_dcb_marks_the_port_range_both_ways(node, image) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport=METAROCE, qos=LOSSY)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok, plan.errors
    assert plan.mode == "metaroce"
    lib = next(s for s in plan.steps if isinstance(s, MetaRoceLibraryStep))
    assert lib.directory.startswith(f"{HOST_ROOT}/rdma-a/0.") and plan.library is not None
    assert plan.library.directory == lib.directory and len(plan.library.checksum) == 64
    marks = [s for s in plan.steps if isinstance(s, TcPortRangeMarkStep)]
    assert [(m.match, m.family, m.first, m.last, m.dscp) for m in marks] == [
        ("dst", "ipv4", 21000, 21999, 26),
        ("src", "ipv4", 21000, 21999, 26),
        ("dst", "ipv6", 21000, 21999, 26),
        ("src", "ipv6", 21000, 21999, 26),
    ]
    assert any(isinstance(s, ClsactStep) for s in plan.steps)
    # a device of its own kind: the netdev, no RDMA device, no rxe link, no rdma_cm
    assert [(d.netdev, d.rdma_device, d.kind) for d in plan.devices] == [("eth0", "", "metaroce")]
    kinds = {s.kind for s in plan.steps}
    assert not kinds & {"rxe-link", "module", "roce-tos", "roce-mode", "rdma-cm-dir"}
    ecn = next(s for s in plan.skipped if s.knob == "ecn")
    assert ecn.satisfied and "switches" in ecn.reason


def test_plan_with_dcb_maps_dscp_and_turns_pfc_off(node, image) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    cfg = make_config(nics={"interfaceNames": ["ens1f0"]}, transport=METAROCE, qos=LOSSY)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok, plan.errors
    assert [s.entries for s in plan.steps if isinstance(s, DcbAppStep)] == [((26, 3),)]
    assert [s.enabled for s in plan.steps if isinstance(s, DcbPfcStep)] == [()]
    assert not any(isinstance(s, TcPortRangeMarkStep | ClsactStep) for s in plan.steps)
    # the RDMA device on the NIC is not what metaroce serves
    assert [d.name for d in plan.devices] == ["ens1f0"]


def test_auto_never_picks_metaroce(node, image) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    inv = n.inventory()
    nds = [inv.netdev("eth0")]
    cfg = make_config(transport={"mode": "auto", "allowSoftRoceFallback": True})
    driver, _, _ = driver_for(cfg, inv, nds)  # type: ignore[arg-type]
    assert isinstance(driver, SoftRoceDriver)
    driver, _, issue = driver_for(make_config(transport={"mode": "auto"}), inv, nds)  # type: ignore[arg-type]
    assert driver is None and issue is not None and "metaroce" not in issue.message.lower()


def test_netdev_without_address_is_reported(node, image) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.netdev("eth9", virtio=True, speed=None)
    cfg = make_config(nics={"interfaceNames": ["eth9"]}, transport=METAROCE, qos=LOSSY)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok and plan.problems
    assert "has no IPv4 address" in plan.problems[0].message


def test_install_verify_and_undo_with_the_real_library(node, image) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    host = _host(n)
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport=METAROCE, qos=LOSSY)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    result = Engine(host, Journal(host, cfg.network)).apply(plan)
    assert result.ok, result
    assert plan.library is not None
    installed = host.path(plan.library.directory)
    assert sorted(
        str(p.relative_to(installed)) for p in installed.rglob("*") if p.is_file()
    ) == sorted([*FILES, "SHA256SUMS"])
    for p in [installed, *installed.rglob("*")]:
        st = p.lstat()
        assert not stat.S_ISLNK(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o222, p
    # the report carries the version and checksum
    state, problems = transport_state(cfg, inv, plan, True)
    assert state.library is not None and state.library.checksum == plan.library.checksum
    assert state.library.directory == plan.library.directory
    assert state.devices == ["eth0"] and state.ready and not problems

    # a damaged install fails verify and is replaced by a new directory, not rewritten
    step = next(s for s in plan.steps if isinstance(s, MetaRoceLibraryStep))
    plugin = installed / "lib/libnccl-net-metaroce.so"
    inode = plugin.stat().st_ino
    os.chmod(plugin, 0o644)
    assert "not root-owned and read-only" in (step.verify(host) or "")
    step.apply(host)
    assert step.verify(host) is None
    assert plugin.stat().st_ino != inode  # a new file, the old one moved aside whole
    aside = [p for p in installed.parent.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1

    # undo leaves nothing of the network behind
    undo = Engine(host, Journal(host, cfg.network)).revert()
    assert not undo.errors, undo.errors
    assert not host.exists(f"{HOST_ROOT}/{cfg.network}")


def test_the_drift_pass_reads_checksums_and_self_tests_only_a_repair(node, image) -> None:  # type: ignore[no-untyped-def]
    # The self-test took 32 s of an emulated node's CPU; each drift pass (every 5
    # minutes, on every node) ran it under the training pods.
    n = node(softroce_node)
    runner = CountingSelfTest(n.kernel, SubprocessRunner())
    host = FixtureHost(n.tree.root, runner=runner)
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport=METAROCE, qos=LOSSY)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    engine = Engine(host, Journal(host, cfg.network))
    assert engine.apply(plan).ok
    assert runner.self_tests == 1  # the apply's verify
    drift = engine.drift(plan)
    assert drift.checked and not drift.repaired and not drift.errors
    assert runner.self_tests == 1  # checksums only
    # a damaged file is still drift: replaced, and the new install self-tested
    assert plan.library is not None
    os.chmod(host.path(plan.library.directory) / "lib/libnccl-net-metaroce.so", 0o644)
    drift = engine.drift(plan)
    assert [s.knob for s, _ in drift.repaired] == ["transport-library"], drift
    assert runner.self_tests == 2


def test_the_self_test_fails_on_a_broken_library(node, image, tmp_path) -> None:  # type: ignore[no-untyped-def]
    broken = tmp_path / "broken"
    shutil.copytree(image, broken)
    (broken / "lib/libnccl-net-metaroce.so").write_bytes(b"\x7fELF not really")
    bundle, _ = read_bundle(str(broken))
    assert bundle is not None
    n = node(softroce_node)
    host = _host(n)
    step = MetaRoceLibraryStep(
        "",
        source=str(broken),
        version=bundle.version,
        checksum=bundle.checksum,
        sums=bundle.sums,
        network="net-b",
    )
    step.apply(host)
    assert check_installed(host.path(step.directory), bundle.sums) is None
    why = step.verify(host) or ""
    assert "self-test" in why and "NCCL plugin" in why, why


def test_undo_keeps_a_version_a_process_maps(node, image) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    host = _host(n)
    bundle, _ = read_bundle()
    assert bundle is not None
    step = MetaRoceLibraryStep(
        "", source=bundle.source, version=bundle.version, checksum=bundle.checksum,
        sums=bundle.sums, network="net-c",
    )  # fmt: skip
    step.apply(host)
    lib = host.path(step.directory) / "lib/libmetaroce-fi.so"
    st = lib.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    n.tree.write("/proc/4242/comm", "python")
    n.tree.write(
        "/proc/4242/maps",
        f"7f00-7f10 r-xp 00000000 {dev} {st.st_ino}    /opt/metaroce/lib/libmetaroce-fi.so\n",
    )
    assert mapped_by(host, step.directory) == {4242: "python"}
    with pytest.raises(Exception, match=r"still in use.*4242 \(python\)"):
        step.undo(host, {"existed": False})
    assert lib.exists()


def test_port_range_marking_apply_verify_undo(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    clsact = ClsactStep("eth0")
    clsact.apply(n.host)
    dst = TcPortRangeMarkStep("eth0", match="dst", first=21000, last=21999, dscp=26, priority=3)
    src = TcPortRangeMarkStep("eth0", match="src", first=21000, last=21999, dscp=26, priority=3)
    assert dst.id != src.id
    for s in (dst, src):
        assert "no MetaRoCE marking filter" in (s.verify(n.host) or "")
        s.apply(n.host)
        assert s.verify(n.host) is None
    assert "dst_port 21000-21999" in " ".join(n.kernel.commands)
    wider = TcPortRangeMarkStep("eth0", match="dst", first=21000, last=22999)
    assert "want 21000-22999" in (wider.verify(n.host) or "")
    dst.undo(n.host, None)
    assert dst.verify(n.host) is not None and src.verify(n.host) is None


def test_device_plugin_gets_one_unit_per_netdev_with_the_library(node, image) -> None:  # type: ignore[no-untyped-def]
    from metaroce_agent.deviceplugin.feed import plugin_devices

    n = node(softroce_node)
    n.tree.netdev("eth9", virtio=True, speed=None)  # no address: advertised unhealthy
    cfg = make_config(nics={"interfaceNames": ["eth0", "eth9"]}, transport=METAROCE, qos=LOSSY)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.library is not None
    devs = plugin_devices(cfg, inv, plan, applied=True)
    assert [(d.rdma_device, d.healthy, d.library_dir) for d in devs] == [
        ("eth0", True, plan.library.directory),
        ("eth9", False, plan.library.directory),
    ]
    env = dict(devs[0].env)
    assert env["MR_CONFIG"].startswith("ports=21000-21999,") and "dscp=26" in env["MR_CONFIG"]
    assert env["MR_TRANSPORT_CHECKSUM"] == plan.library.checksum
    # a failed read-back of the library (node-wide) makes every unit unhealthy
    assert not any(d.healthy for d in plugin_devices(cfg, inv, plan, applied=True, failing=[""]))


def test_unused_versions_are_removed_held_and_mapped_ones_stay(node, image) -> None:  # type: ignore[no-untyped-def]
    from metaroce_agent.transport.library import remove_unused_versions

    n = node(softroce_node)
    host = _host(n)
    bundle, _ = read_bundle()
    assert bundle is not None
    dirs = []
    for version in ("0.0.1", "0.0.2", "0.0.3"):
        step = MetaRoceLibraryStep(
            "", source=bundle.source, version=version, checksum=bundle.checksum,
            sums=bundle.sums, network="net-d",
        )  # fmt: skip
        step.apply(host)
        dirs.append(step.directory)
    old, held, current = dirs
    removed, notes = remove_unused_versions(host, "net-d", current, {"eth0-0": held}, {"eth0-0"})
    assert removed == [old] and notes == []
    assert not host.exists(old) and host.exists(held) and host.exists(current)
    # a held unit with no record keeps everything
    removed, notes = remove_unused_versions(host, "net-d", current, {}, {"eth0-1"})
    assert removed == [] and "eth0-1" in notes[0]
