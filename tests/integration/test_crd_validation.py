"""The generated CRDs on a real apiserver: accepted, defaulted, and rejecting bad objects
with errors that name the field, exactly where the Python models reject them too."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_api import (
    InvalidObject,
    MetaRoceNetwork,
    MetaRoceNetworkStatus,
    MetaRoceNodeStateStatus,
    Rule,
    all_rules,
    constants,
    validate_network,
    validate_nodestate,
)
from metaroce_api.base import Case
from metaroce_api.examples import (
    case_objects,
    full_network,
    merge,
    minimal_network,
    minimal_nodestate,
)

pytestmark = pytest.mark.integration

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
RUN = secrets.token_hex(3)
"""Suffix of every object name: the kinds are cluster-scoped and the cluster is shared."""


def unique(stem: str) -> str:
    return f"{stem[: 62 - len(RUN)]}-{RUN}"


@pytest.fixture(scope="module")
def kube(cluster: Any) -> Iterator[Any]:
    """The session cluster with the CRDs applied the way users apply them."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        f"crd/{constants.NETWORK_CRD_NAME}",
        f"crd/{constants.NODESTATE_CRD_NAME}",
    )
    yield cluster
    for plural in (constants.NETWORK_PLURAL, constants.NODESTATE_PLURAL):
        names = cluster.kubectl("get", plural, "-o", "name", check=False).stdout.split()
        mine = [n for n in names if n.endswith(f"-{RUN}") or f"-{RUN}." in n]
        if mine:
            cluster.kubectl("delete", "--wait=false", "--ignore-not-found", *mine, check=False)


def create(kube: Any, obj: dict[str, Any]) -> Any:
    return kube.kubectl(
        "create", "--validate=strict", "-f", "-", input=json.dumps(obj), check=False
    )


def replace(kube: Any, obj: dict[str, Any]) -> Any:
    return kube.kubectl(
        "replace", "--validate=strict", "-f", "-", input=json.dumps(obj), check=False
    )


def get(kube: Any, plural: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(kube.kubectl("get", plural, name, "-o", "json").stdout)
    return out


def assert_rejected(proc: Any, field: str, what: str) -> None:
    assert proc.returncode != 0, f"{what}: the apiserver accepted it"
    assert field in proc.stderr, f"{what}: the error does not name {field}:\n{proc.stderr}"


def assert_accepted(proc: Any, what: str) -> None:
    assert proc.returncode == 0, f"{what}: rejected:\n{proc.stderr}"


# --- every CEL rule: one rejected and one accepted object -----------------------------


def _submit(kube: Any, rule: Rule, case: Case, name: str) -> Any:
    before, obj = case_objects(rule, case, name)
    if before is None:
        return create(kube, obj)
    assert_accepted(create(kube, before), f"{rule.name}: creating the original")
    return replace(kube, obj)


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.name)
def test_cel_rule_rejects_naming_the_field(kube: Any, rule: Rule) -> None:
    assert rule.rejects is not None
    proc = _submit(kube, rule, rule.rejects, unique(f"no-{rule.name}"))
    assert_rejected(proc, rule.rejects.field, rule.name)
    assert rule.message in proc.stderr


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.name)
def test_cel_rule_accepts(kube: Any, rule: Rule) -> None:
    assert rule.accepts is not None
    assert_accepted(_submit(kube, rule, rule.accepts, unique(f"ok-{rule.name}")), rule.name)


# --- malformed networks beyond the CEL rules --------------------------------------------

MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    # wrong types
    ("dscp-not-int", {"spec": {"qos": {"data": {"dscp": "af31"}}}}, "spec.qos.data.dscp"),
    ("globs-not-list", {"spec": {"nics": {"interfaceNames": "eth1"}}}, "spec.nics.interfaceNames"),
    ("cleanup-not-bool", {"spec": {"cleanupOnDelete": "yes"}}, "spec.cleanupOnDelete"),
    ("transport-not-object", {"spec": {"transport": "rocev2"}}, "spec.transport"),
    (
        "max-unavailable-bool",
        {"spec": {"agent": {"updateStrategy": {"maxUnavailable": True}}}},
        "spec.agent.updateStrategy.maxUnavailable",
    ),
    # out of range
    ("dscp-64", {"spec": {"qos": {"data": {"dscp": 64}}}}, "spec.qos.data.dscp"),
    ("cnp-dscp-negative", {"spec": {"qos": {"cnp": {"dscp": -1}}}}, "spec.qos.cnp.dscp"),
    ("priority-8", {"spec": {"qos": {"data": {"priority": 8}}}}, "spec.qos.data.priority"),
    (
        "pfc-priority-9",
        {"spec": {"qos": {"profile": "custom", "pfcPriorities": [9]}}},
        "spec.qos.pfcPriorities",
    ),
    ("mtu-100", {"spec": {"transport": {"mtu": 100}}}, "spec.transport.mtu"),
    ("retry-8", {"spec": {"transport": {"retryCount": 8}}}, "spec.transport.retryCount"),
    ("ack-timeout-0", {"spec": {"transport": {"ackTimeout": 0}}}, "spec.transport.ackTimeout"),
    (
        "taint-fraction-1.5",
        {"spec": {"health": {"maxTaintedFraction": 1.5}}},
        "spec.health.maxTaintedFraction",
    ),
    # unknown enum values
    (
        "transport-infiniband",
        {"spec": {"transport": {"mode": "infiniband"}}},
        "spec.transport.mode",
    ),
    ("profile-best-effort", {"spec": {"qos": {"profile": "best-effort"}}}, "spec.qos.profile"),
    (
        "on-unsupported-ignore",
        {"spec": {"qos": {"onUnsupported": "ignore"}}},
        "spec.qos.onUnsupported",
    ),
    (
        "nccl-debug",
        {"spec": {"attachment": {"ncclEnv": ["NCCL_DEBUG"]}}},
        "spec.attachment.ncclEnv",
    ),
    # oversized lists and strings
    (
        "33-globs",
        {"spec": {"nics": {"interfaceNames": [f"eth{i}" for i in range(33)]}}},
        "spec.nics.interfaceNames",
    ),
    (
        "33-tolerations",
        {"spec": {"tolerations": [{"key": f"k{i}", "operator": "Exists"} for i in range(33)]}},
        "spec.tolerations",
    ),
    (
        "9-ets-shares",
        {"spec": {"qos": {"ets": [{"priority": p % 8, "bandwidthPercent": 10} for p in range(9)]}}},
        "spec.qos.ets",
    ),
    (
        "glob-65-chars",
        {"spec": {"nics": {"interfaceNames": ["e" * 65]}}},
        "spec.nics.interfaceNames",
    ),
    # duplicates, patterns, missing and unknown fields, names
    (
        "duplicate-driver",
        {"spec": {"nics": {"drivers": ["mlx5_core", "mlx5_core"]}}},
        "spec.nics.drivers",
    ),
    ("vendor-not-hex", {"spec": {"nics": {"pciVendorIds": ["15bx"]}}}, "spec.nics.pciVendorIds"),
    (
        "resource-name-no-domain",
        {"spec": {"attachment": {"resourceName": "rdma"}}},
        "spec.attachment.resourceName",
    ),
    (
        "interval-in-words",
        {"spec": {"health": {"probe": {"interval": "30 seconds"}}}},
        "spec.health.probe.interval",
    ),
    ("no-nics", {"spec": {"nics": None}}, "spec.nics"),
    ("metrics-port-70000", {"spec": {"agent": {"metricsPort": 70000}}}, "spec.agent.metricsPort"),
    ("log-level-loud", {"spec": {"agent": {"logLevel": "loud"}}}, "spec.agent.logLevel"),
    (
        "selector-operator-near",
        {"spec": {"nodeSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}},
        "spec.nodeSelector.matchExpressions[0].operator",
    ),
    ("unknown-field", {"spec": {"transport": {"mdoe": "rocev2"}}}, "spec.transport.mdoe"),
    (
        "toleration-bad-effect",
        {"spec": {"tolerations": [{"key": "k", "effect": "NoRun"}]}},
        "spec.tolerations[0].effect",
    ),
]


@pytest.mark.parametrize(("stem", "patch", "field"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_network_is_rejected_naming_the_field(
    kube: Any, stem: str, patch: dict[str, Any], field: str
) -> None:
    obj = merge(minimal_network(unique(f"bad-{stem}")), patch)
    assert_rejected(create(kube, obj), field, stem)
    with pytest.raises(InvalidObject) as err:
        validate_network(obj)
    assert any(i.path.startswith(field) for i in err.value.issues), err.value


def test_network_name_longer_than_a_label_is_rejected(kube: Any) -> None:
    obj = minimal_network(("n" * 64)[: 63 - len(RUN)] + "-" + RUN)  # 64 characters
    assert_rejected(create(kube, obj), "metadata.name", "64-character name")


def _constrained_sections() -> set[str]:
    """The spec's top-level fields whose schema constrains something (a bound, an enum, a
    pattern, a list or length limit, required fields), from the generated CRD."""
    crd = yaml.safe_load((CRD_DIR / "metaroce.io_metarocenetworks.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    keys = ("enum", "maximum", "minimum", "maxItems", "pattern", "maxLength", "required")

    def constrained(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if any(k in node for k in keys):
            return True
        children = [*(node.get("properties") or {}).values(), node.get("items")]
        return any(constrained(child) for child in children)

    return {name for name, sub in spec["properties"].items() if constrained(sub)}


def test_every_constrained_spec_section_has_a_malformed_case() -> None:
    """Not a count of this file's own list (that could not fail): each part of the spec
    the CRD constrains is exercised by at least one malformed network above."""
    covered = {field.split(".")[1].split("[")[0] for _, _, field in MALFORMED}
    missing = _constrained_sections() - covered
    assert not missing, f"no malformed case for spec.{', spec.'.join(sorted(missing))}"


# --- accepted networks, defaults, status, printer columns -------------------------------

GOOD: list[tuple[str, dict[str, Any]]] = [
    ("minimal", minimal_network()),
    ("full", full_network()),
    (
        "metaroce-lossy",
        merge(
            minimal_network(),
            {"spec": {"transport": {"mode": "metaroce"}, "qos": {"profile": "lossy"}}},
        ),
    ),
    (
        "softroce-custom",
        merge(
            minimal_network(),
            {
                "spec": {
                    "nics": {"interfaceNames": None, "drivers": ["virtio_net"]},
                    "transport": {"mode": "softroce", "mtu": 1500},
                    "qos": {"profile": "custom", "ecn": False, "onUnsupported": "skip"},
                    "attachment": {"podsPerDevice": 8},
                    "agent": {"updateStrategy": {"maxUnavailable": 3}},
                }
            },
        ),
    ),
]


@pytest.mark.parametrize(("stem", "obj"), GOOD, ids=[g[0] for g in GOOD])
def test_good_network_is_stored_as_python_reads_it(
    kube: Any, stem: str, obj: dict[str, Any]
) -> None:
    name = unique(f"good-{stem}")
    obj = merge(obj, {"metadata": {"name": name}})
    assert_accepted(create(kube, obj), stem)
    stored = get(kube, constants.NETWORK_PLURAL, name)
    # The apiserver's defaults are the Python defaults.
    assert stored["spec"] == validate_network(obj).to_api()["spec"]


def test_status_subresource_and_printer_columns(kube: Any) -> None:
    name = unique("columns")
    assert_accepted(create(kube, minimal_network(name)), "columns")
    status = MetaRoceNetworkStatus.model_validate(
        {
            "observedGeneration": 1,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": constants.REASON_RECONCILED,
                    "message": "all nodes configured",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                    "observedGeneration": 1,
                }
            ],
            "nodes": {"desired": 4, "configured": 3, "healthy": 3, "failed": 1},
            "failingNodes": [{"node": "kwok-b1", "reason": "PfcUnsupported", "message": "no DCB"}],
            "transport": {"active": "rocev2", "nodesByMode": {"rocev2": 3}},
        }
    )
    kube.kubectl(
        "patch",
        constants.NETWORK_PLURAL,
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status.to_api()}),
    )
    stored = MetaRoceNetwork.model_validate(get(kube, constants.NETWORK_PLURAL, name))
    assert stored.status == status
    table = kube.kubectl("get", "mrn", name).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "NODES", "TRANSPORT", "AGE"]
    assert table[1].split()[:4] == [name, "True", "3/4", "rocev2"]


def test_nodestate_is_written_whole_in_one_request(kube: Any) -> None:
    """No status subresource on NodeStates: the agent's first report (spec and status) is
    one create, a later one a merge patch of the object itself; spec stays immutable."""
    obj = minimal_nodestate(network=unique("ns"), node="kwok-a1")
    name = obj["metadata"]["name"]
    status = MetaRoceNodeStateStatus.model_validate(
        {
            "phase": "Degraded",
            "configGeneration": 2,
            "inventory": [
                {"netdev": "eth1", "rdmaDevice": "rxe0", "rdmaKind": "softroce", "mtu": 1500}
            ],
            "qos": {
                "applied": [{"name": "roce-tos", "value": "104", "method": "configfs"}],
                "skipped": [{"name": "pfc", "device": "eth1", "reason": "virtio_net has no DCB"}],
            },
            "transport": {"mode": "softroce", "ready": True, "devices": ["rxe0"]},
            "probe": {
                "healthy": True,
                "peers": [
                    # the samples behind the verdict are kept, not pruned by the schema
                    {
                        "node": "kwok-a2",
                        "reachable": True,
                        "latencySamples": 300,
                        "lossDatagrams": 600,
                    },
                ],
            },
            "errors": [{"step": "apply pfc on eth1", "message": "unsupported"}],
        }
    )
    assert_accepted(create(kube, {**obj, "status": status.to_api()}), "nodestate")
    stored = validate_nodestate(get(kube, constants.NODESTATE_PLURAL, name))
    assert stored.status == status
    row = kube.kubectl("get", "mrns", name, "--no-headers").stdout.split()
    assert row[:6] == [name, obj["spec"]["network"], "kwok-a1", "Degraded", "softroce", "2"]

    # A later report: a JSON merge patch of the object, status only (null removes).
    patch = {"status": {"phase": "Ready", "errors": None}}
    kube.kubectl("patch", constants.NODESTATE_PLURAL, name, "--type=merge", "-p", json.dumps(patch))
    stored = validate_nodestate(get(kube, constants.NODESTATE_PLURAL, name))
    assert stored.status == status.model_copy(update={"phase": "Ready", "errors": None})
    # The status is validated by the same schema, and the spec stays immutable.
    bad = kube.kubectl(
        "patch", constants.NODESTATE_PLURAL, name, "--type=merge",
        "-p", json.dumps({"status": {"phase": "Sleeping"}}), check=False,
    )  # fmt: skip
    assert_rejected(bad, "status.phase", "an unknown phase")
    moved = kube.kubectl(
        "patch", constants.NODESTATE_PLURAL, name, "--type=merge",
        "-p", json.dumps({"spec": {"node": "kwok-a2"}}), check=False,
    )  # fmt: skip
    assert_rejected(moved, "spec", "a changed spec")
    # There is no status subresource to write to.
    sub = kube.kubectl(
        "patch", constants.NODESTATE_PLURAL, name, "--subresource=status", "--type=merge",
        "-p", json.dumps(patch), check=False,
    )  # fmt: skip
    assert sub.returncode != 0


def test_crds_in_the_chart_are_the_same_files() -> None:
    chart = CRD_DIR.parent / "charts" / "metaroce" / "files" / "crds"
    for path in sorted(CRD_DIR.glob("*.yaml")):
        assert yaml.safe_load(path.read_text()) == yaml.safe_load((chart / path.name).read_text())
