"""Planning over fixture nodes: which knob through which mechanism, skips and errors."""

from __future__ import annotations

from conftest import make_config
from fakes import mellanox_node, no_rdma_node, port_down_node, softroce_node, two_numa_node

from metaroce_agent.plan import make_plan
from metaroce_agent.qos.dcb import DcbAppStep, DcbEtsStep, DcbPfcStep
from metaroce_agent.qos.ecn import CnpStep, EcnStep
from metaroce_agent.qos.rocecm import RoceModeStep, RoceTosStep
from metaroce_agent.qos.tcmark import TcMarkStep
from metaroce_agent.transport.softroce import RxeLinkStep

SOFT = {"mode": "softroce"}


def kinds(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return [s.kind for s in plan.steps]


def skipped(plan) -> dict[tuple[str, str], bool]:  # type: ignore[no-untyped-def]
    return {(s.knob, s.device): s.satisfied for s in plan.skipped}


def test_mellanox_lossless_uses_dcb_ecn_and_configfs(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    cfg = make_config(nics={"interfaceNames": ["ens1f0"]}, transport={"mode": "rocev2"})
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok and plan.mode == "rocev2" and plan.netdevs == ("ens1f0",)
    assert kinds(plan) == [
        "kernel-module", "kernel-module", "dcb-app", "dcb-app", "dcb-pfc", "ecn",
        "cnp-marking", "rdma-cm-dir", "roce-mode", "roce-tos",
    ]  # fmt: skip
    by_kind = {s.kind: s for s in plan.steps}
    # one APP step per DSCP, so that a DSCP the config drops is a step undone
    assert [s for s in plan.steps if s.kind == "dcb-app"] == [
        DcbAppStep("ens1f0", entries=((26, 3),)),
        DcbAppStep("ens1f0", entries=((48, 6),)),
    ]
    assert by_kind["dcb-pfc"] == DcbPfcStep("ens1f0", enabled=(3,))
    assert by_kind["ecn"] == EcnStep("ens1f0", priority=3, enable=True)
    assert by_kind["cnp-marking"] == CnpStep("ens1f0", dscp=48, priority=6)
    assert by_kind["roce-tos"] == RoceTosStep("mlx5_0", port=1, tos=104)
    assert by_kind["roce-mode"] == RoceModeStep("mlx5_0", port=1, mode="RoCE v2")
    assert plan.skipped == ()


def test_mellanox_lossy_turns_pfc_off_and_keeps_ecn(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    cfg = make_config(
        nics={"interfaceNames": ["ens1f0"]},
        qos={
            "profile": "lossy",
            "ets": [
                {"priority": 3, "bandwidthPercent": 60},
                {"priority": 0, "bandwidthPercent": 40},
            ],
        },
    )
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.mode == "rocev2"  # auto picked the hardware
    by_kind = {s.kind: s for s in plan.steps}
    assert by_kind["dcb-pfc"] == DcbPfcStep("ens1f0", enabled=())
    assert by_kind["dcb-pfc"].value() == "off"
    assert by_kind["dcb-ets"] == DcbEtsStep("ens1f0", shares=((3, 60), (0, 40)))
    assert by_kind["ecn"] == EcnStep("ens1f0", priority=3, enable=True)


def test_softroce_over_virtio_marks_with_tc_and_skips_dcb(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport=SOFT)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok and plan.mode == "softroce"
    assert kinds(plan) == [
        "kernel-module", "kernel-module", "kernel-module", "rxe-link", "tc-clsact", "tc-mark",
        "kernel-module", "rdma-cm-dir", "roce-mode", "roce-tos",
    ]  # fmt: skip
    rxe = next(s for s in plan.steps if isinstance(s, RxeLinkStep))
    assert (rxe.device, rxe.netdev) == ("rxe_eth0", "eth0")
    mark = next(s for s in plan.steps if isinstance(s, TcMarkStep))
    assert (mark.dscp, mark.priority, mark.tos) == (26, 3, 0x68)
    assert [d.rdma_device for d in plan.devices] == ["rxe_eth0"]
    sk = skipped(plan)
    assert sk[("pfc", "eth0")] is False  # lossless wants PFC: really missing
    assert sk[("ecn", "eth0")] is False
    assert sk[("cnp-marking", "eth0")] is True
    reason = next(s.reason for s in plan.skipped if s.knob == "pfc")
    assert "no DCB" in reason and "Operation not supported" in reason


def test_softroce_lossy_pfc_is_satisfied_without_dcb(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node, veth=True)
    cfg = make_config(nics={"interfaceNames": ["veth*"]}, transport=SOFT, qos={"profile": "lossy"})
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok and plan.netdevs == ("veth0",)
    assert skipped(plan)[("pfc", "veth0")] is True
    assert "tc-mark" in kinds(plan)


def test_on_unsupported_error_blocks_the_whole_plan(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = make_config(
        nics={"interfaceNames": ["eth0"]}, transport=SOFT, qos={"onUnsupported": "error"}
    )
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert not plan.ok
    wheres = {e.where for e in plan.errors}
    assert wheres == {"qos pfc on eth0", "qos ecn on eth0"}
    assert all("onUnsupported is error" in e.message for e in plan.errors)


def test_skip_knob_turns_tc_marking_off(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport=SOFT)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv), skip_knobs={"dscp-mark"})
    assert "tc-mark" not in kinds(plan) and "tc-clsact" not in kinds(plan)
    assert skipped(plan)[("dscp-mark", "eth0")] is True


def test_node_without_rdma(node) -> None:  # type: ignore[no-untyped-def]
    n = node(no_rdma_node)
    cfg = make_config(nics={"drivers": ["igb"]})
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert not plan.ok and plan.steps == ()
    assert "allowSoftRoceFallback is false" in plan.errors[0].message
    cfg = make_config(nics={"drivers": ["igb"]}, transport={"allowSoftRoceFallback": True})
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok and plan.mode == "softroce"
    # igb without DCB here: rxe packets are marked by tc
    assert "tc-mark" in kinds(plan) and "dcb-app" not in kinds(plan)
    n.kernel.dcb_devices.add("eno1")  # with DCB: both the APP table and the tc marking
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert "tc-mark" in kinds(plan) and "dcb-app" in kinds(plan) and "dcb-pfc" in kinds(plan)
    cfg = make_config(nics={"interfaceNames": ["nothing*"]})
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.errors[0].where == "select nics" and "eno1" in plan.errors[0].message
    cfg = make_config(nics={"drivers": ["igb"]}, transport={"mode": "rocev2"})
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert not plan.ok and "no hardware RDMA device" in plan.errors[0].message


def test_port_down_is_a_problem_not_a_blocker(node) -> None:  # type: ignore[no-untyped-def]
    n = node(port_down_node)
    cfg = make_config()
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok and plan.netdevs == ("ens1f0", "ens1f1")
    assert [p.where for p in plan.problems] == ["transport rocev2 on mlx5_1"]
    assert "port 1 is DOWN (physical state Disabled)" in plan.problems[0].message
    assert {s.device for s in plan.steps if s.kind == "roce-tos"} == {"mlx5_0", "mlx5_1"}


def test_two_numa_nodes_get_both_nics(node) -> None:  # type: ignore[no-untyped-def]
    n = node(two_numa_node)
    cfg = make_config(nics={"pciVendorIds": ["15b3"]}, transport={"mtu": 4200})
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.ok and plan.netdevs == ("ens1f0", "ens7f0")
    assert [s.device for s in plan.steps if s.kind == "mtu"] == ["ens1f0", "ens7f0"]
    assert [d.rdma_device for d in plan.devices] == ["mlx5_0", "mlx5_1"]


def test_metaroce_without_its_library_is_a_clear_error_not_a_fallback(  # type: ignore[no-untyped-def]
    node, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("METAROCE_TRANSPORT_DIR", str(tmp_path / "no-transport"))
    n = node(mellanox_node)
    cfg = make_config(transport={"mode": "metaroce"}, qos={"profile": "lossy"})
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert not plan.ok and plan.mode == "metaroce" and plan.steps == ()
    assert "has no MetaRoCE transport" in plan.errors[0].message
    assert "hack/stage-transport.sh" in plan.errors[0].message


def test_rdma_device_glob_selects_existing_rxe(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("rxe0", netdev="eth0", software=True)
    cfg = make_config(nics={"rdmaDevices": ["rxe*"]}, transport=SOFT)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    assert plan.netdevs == ("eth0",)
    rxe = next(s for s in plan.steps if isinstance(s, RxeLinkStep))
    assert rxe.device == "rxe0"  # adopted, not a second link
    assert "adopted existing rxe link rxe0" in plan.transport_message


def test_planning_is_pure(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    cfg = make_config()
    inv = n.inventory()
    caps = n.caps(cfg, inv)
    before = list(n.kernel.calls)
    assert make_plan(cfg, inv, caps) == make_plan(cfg, inv, caps)
    assert n.kernel.calls == before
