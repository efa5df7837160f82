"""NodeState status building and write-only-on-change."""

from __future__ import annotations

from typing import Any

from conftest import make_config
from fakes import port_down_node, softroce_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.kube import KubeError
from metaroce_agent.plan import make_plan
from metaroce_agent.report import (
    ErrorLog,
    NodeStateWriter,
    build_status,
    change_key,
    merge_patch,
)
from metaroce_api import MetaRoceNodeState, ProbePeer, ProbeSummary


def applied_softroce(n):  # type: ignore[no-untyped-def]
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"})
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan)
    return cfg, plan, result


def test_ready_softroce_status(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg, plan, result = applied_softroce(n)
    status = build_status(
        config=cfg, inventory=n.inventory(), plan=plan, result=result, errors=ErrorLog(),
        drift_corrections=0,
    )  # fmt: skip
    assert status.phase == "Ready" and status.config_generation == 3
    assert status.transport is not None
    assert status.transport.mode == "softroce" and status.transport.ready
    assert status.transport.devices == ["rxe_eth0"]
    assert status.inventory is not None
    dev = status.inventory[0]
    assert (dev.netdev, dev.rdma_device, dev.rdma_kind, dev.driver) == (
        "eth0", "rxe_eth0", "softroce", "virtio_net",
    )  # fmt: skip
    assert dev.gid == "0000:0000:0000:0000:0000:ffff:c0a8:4d0b" and dev.gid_index == 1
    assert status.qos is not None and status.qos.applied and status.qos.skipped
    applied = {(k.name, k.device): (k.value, k.method) for k in status.qos.applied}
    assert applied[("dscp-mark", "eth0")][1] == "tc"
    assert applied[("roce-tos", "rxe_eth0")] == ("104 (dscp 26)", "configfs")
    assert {k.name for k in status.qos.skipped} == {"pfc", "ecn", "cnp-marking"}
    assert status.conditions is not None and status.conditions[0].status == "True"
    # the status is a valid NodeState status
    MetaRoceNodeState.model_validate(
        {"metadata": {"name": "x"}, "spec": {"network": "rdma-a", "node": "n"},
         "status": status.to_api()}
    )  # fmt: skip


def test_failed_apply_is_reported_with_the_step(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.host.unwritable.add("/sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos")
    cfg, plan, result = applied_softroce(n)
    errors = ErrorLog()
    errors.set([("apply roce-tos port1 on rxe_eth0", result.error)])
    status = build_status(
        config=cfg, inventory=n.inventory(), plan=plan, result=result, errors=errors,
        drift_corrections=0,
    )  # fmt: skip
    assert status.phase == "Failed"
    assert status.conditions is not None
    assert status.conditions[0].reason == "ApplyFailed"
    assert "roce-tos port1 on rxe_eth0 failed" in status.conditions[0].message
    assert status.errors is not None and "Permission denied" in status.errors[0].message
    assert status.qos is not None and status.qos.applied is None
    assert status.transport is not None and not status.transport.ready


def test_port_down_is_degraded(node) -> None:  # type: ignore[no-untyped-def]
    n = node(port_down_node)
    cfg = make_config()
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan)
    status = build_status(
        config=cfg, inventory=inv, plan=plan, result=result, errors=ErrorLog(),
        drift_corrections=0,
    )  # fmt: skip
    assert status.phase == "Degraded"
    assert status.errors is not None
    assert any("mlx5_1 port 1 is DOWN" in e.message for e in status.errors)
    assert status.transport is not None and status.transport.devices == ["mlx5_0"]


def test_change_key_ignores_clocks_and_latency_jitter(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg, plan, result = applied_softroce(n)
    inv = n.inventory()

    def status(p50: float, healthy: bool = True):  # type: ignore[no-untyped-def]
        probe = ProbeSummary(
            healthy=healthy,
            peers=[ProbePeer(node="node-2", reachable=True, latency_p50_microseconds=p50)],
        )
        return build_status(
            config=cfg, inventory=inv, plan=plan, result=result, errors=ErrorLog(),
            drift_corrections=0, probe=probe,
        )  # fmt: skip

    a, b = status(50.0), status(70.0)
    assert change_key(a) == change_key(b)
    assert change_key(a) != change_key(status(50.0, healthy=False))


class FakeKube:
    """Records the writer's requests; `existing` makes the create answer 409 (take-over)."""

    def __init__(self, existing: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.existing = existing

    def create(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        assert field_manager == "metaroce-agent"
        self.calls.append(("create", path, body))
        if self.existing is not None:
            raise KubeError(409, "already exists")
        return body

    def apply(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        assert field_manager == "metaroce-agent"
        self.calls.append(("apply", path, body))
        return {**body, "status": (self.existing or {}).get("status")}

    def merge_patch(self, path: str, patch: dict[str, Any], field_manager: str) -> dict[str, Any]:
        assert field_manager == "metaroce-agent"
        self.calls.append(("merge", path, patch))
        return patch


PATH = "/apis/metaroce.io/v1alpha1/metarocenodestates"


def test_writer_creates_once_and_patches_only_changes(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg, plan, result = applied_softroce(n)
    kube = FakeKube()
    w = NodeStateWriter(kube, "rdma-a", "node-1")  # type: ignore[arg-type]
    s = build_status(
        config=cfg, inventory=n.inventory(), plan=plan, result=result, errors=ErrorLog(),
        drift_corrections=0,
    )  # fmt: skip
    assert w.write(s) is True
    assert [(verb, p) for verb, p, _ in kube.calls] == [
        ("create", PATH),
        ("merge", f"{PATH}/rdma-a.node-1/status"),
    ]
    obj = kube.calls[0][2]
    assert obj["metadata"]["name"] == "rdma-a.node-1"
    assert obj["spec"] == {"network": "rdma-a", "node": "node-1"}
    assert obj["metadata"]["labels"]["metaroce.io/network"] == "rdma-a"
    assert kube.calls[1][2] == {"status": s.to_api()}
    assert w.write(s) is False and len(kube.calls) == 2
    s2 = s.model_copy(update={"drift_corrections": 1})
    assert w.write(s2) is True and len(kube.calls) == 3
    # Only what changed goes out.
    assert kube.calls[2][2] == {"status": {"driftCorrections": 1}}
    # A changed annotation is applied to the existing object, not created again.
    w.set_annotation("metaroce.io/probe-endpoint", "10.0.0.1:47911")
    s3 = s2.model_copy(update={"drift_corrections": 2})
    assert w.write(s3) is True
    assert [verb for verb, _, _ in kube.calls[3:]] == ["apply", "merge"]
    assert w.writes == 3


def test_writer_takes_over_an_existing_nodestate(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg, plan, result = applied_softroce(n)
    s = build_status(
        config=cfg, inventory=n.inventory(), plan=plan, result=result, errors=ErrorLog(),
        drift_corrections=0,
    )  # fmt: skip
    old = {**s.to_api(), "errors": [{"step": "x", "message": "y", "time": "2026-01-01T00:00:00Z"}]}
    kube = FakeKube(existing={"status": old})
    w = NodeStateWriter(kube, "rdma-a", "node-1")  # type: ignore[arg-type]
    assert w.write(s) is True
    assert [verb for verb, _, _ in kube.calls] == ["create", "apply", "merge"]
    # The previous agent's stale error is removed (merge patch null), the rest stays.
    assert kube.calls[2][2] == {"status": {"errors": None}}


def test_merge_patch_is_rfc7386() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2], "gone": "x"}
    new = {"a": 1, "b": {"c": 2, "e": 4}, "l": [1], "added": {"f": 5}}
    assert merge_patch(old, new) == {
        "gone": None,
        "b": {"d": None, "e": 4},
        "l": [1],
        "added": {"f": 5},
    }
    assert merge_patch(new, new) == {}
    assert merge_patch({}, new) == new
