"""The models: defaults that match common practice, wire format, helpers."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from metaroce_api import (
    AgentConfig,
    MetaRoceNetwork,
    MetaRoceNodeState,
    NodeCounts,
    QosSpec,
    constants,
    nodestate_labels,
    nodestate_name,
    parse_duration,
    validate_network,
)
from metaroce_api.examples import full_network, merge, minimal_network, minimal_nodestate


def test_minimal_network_gets_classic_rocev2_lossless_defaults() -> None:
    net = validate_network(minimal_network("fabric"))
    qos = net.spec.qos
    assert qos.profile == "lossless"
    assert (qos.data.dscp, qos.data.priority) == (26, 3)
    assert (qos.cnp.dscp, qos.cnp.priority) == (48, 6)
    assert qos.effective_pfc_priorities() == [3]
    assert qos.ecn is True
    assert net.spec.transport.mode == "auto"
    assert net.spec.transport.roce.version == 2
    assert net.spec.cleanup_on_delete is False
    assert net.resource_name == "metaroce.io/fabric"
    assert net.spec.agent.update_strategy.max_unavailable == 1


def test_lossy_profile_has_no_pfc_and_keeps_ecn() -> None:
    qos = QosSpec(profile="lossy")
    assert qos.effective_pfc_priorities() == []
    assert qos.ecn is True


def test_pfc_follows_a_moved_data_priority() -> None:
    qos = QosSpec.model_validate({"data": {"priority": 5}})
    assert qos.effective_pfc_priorities() == [5]


def test_wire_format_is_camel_case_and_round_trips() -> None:
    obj = merge(
        minimal_network(),
        {"spec": {"transport": {"allowSoftRoceFallback": True, "qpsPerConnection": 4}}},
    )
    net = MetaRoceNetwork.model_validate(obj)
    wire = net.to_api()
    assert wire["spec"]["transport"]["allowSoftRoceFallback"] is True
    assert wire["spec"]["transport"]["qpsPerConnection"] == 4
    assert "allow_soft_roce_fallback" not in str(wire)
    assert MetaRoceNetwork.model_validate(wire) == net
    # Python names work too (populate_by_name).
    assert net.spec.transport.qps_per_connection == 4


def test_spec_refuses_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="pfcPriority"):
        MetaRoceNetwork.model_validate(
            merge(minimal_network(), {"spec": {"qos": {"pfcPriority": 3}}})
        )


def test_status_and_nodestate_tolerate_unknown_fields() -> None:
    obj = merge(minimal_nodestate(), {"status": {"phase": "Ready", "fromTheFuture": 1}})
    obj["metadata"]["managedFields"] = [{"manager": "x"}]
    state = MetaRoceNodeState.model_validate(obj)
    assert state.status is not None and state.status.phase == "Ready"


def test_node_counts_summary_is_derived() -> None:
    counts = NodeCounts.model_validate({"desired": 4, "configured": 3, "summary": "lies"})
    assert counts.summary == "3/4"


def test_nodestate_names_and_labels_fit_kubernetes_limits() -> None:
    assert nodestate_name("fabric", "node-a") == "fabric.node-a"
    long_node = "n" * 250
    name = nodestate_name("fabric", long_node)
    assert len(name) <= 253
    assert name != nodestate_name("fabric", long_node + "x")
    labels = nodestate_labels("fabric", long_node)
    assert labels[constants.NETWORK_LABEL] == "fabric"
    assert len(labels[constants.NODE_LABEL]) <= 63


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("5m", 300), ("1h30m", 5400), ("500ms", 0.5), ("1m5s", 65)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


def test_parse_duration_says_how_to_write_one() -> None:
    with pytest.raises(ValueError, match=r"e\.g\. 30s"):
        parse_duration("30 seconds")


def test_agent_config_carries_what_the_node_needs_and_round_trips() -> None:
    obj = merge(
        minimal_network("fabric"),
        {"metadata": {"generation": 7}, "spec": {"qos": {"profile": "lossy"}}},
    )
    config = AgentConfig.from_network(validate_network(obj))
    assert config.network == "fabric"
    assert config.generation == 7
    assert config.resource_name == "metaroce.io/fabric"
    assert config.qos.profile == "lossy"
    text = config.to_yaml()
    assert "resourceName: metaroce.io/fabric" in text
    assert AgentConfig.from_yaml(text) == config


def test_constants_spell_the_api() -> None:
    assert (
        constants.API_VERSION == f"{constants.GROUP}/{constants.VERSION}" == "metaroce.io/v1alpha1"
    )
    assert f"{constants.NETWORK_PLURAL}.{constants.GROUP}" == constants.NETWORK_CRD_NAME
    assert f"{constants.NODESTATE_PLURAL}.{constants.GROUP}" == constants.NODESTATE_CRD_NAME
    assert constants.NETWORKS_ANNOTATION == "metaroce.io/networks"
    assert constants.CLEANUP_FINALIZER == "metaroce.io/cleanup"
    assert constants.UNHEALTHY_TAINT_KEY == "metaroce.io/rdma-unhealthy"
    assert constants.FIELD_MANAGER == "metaroce-operator"
    assert constants.RESOURCE_NAME_TEMPLATE.format(network="n") == "metaroce.io/n"


def test_full_example_round_trips_unchanged() -> None:
    obj = full_network("full")
    assert validate_network(obj).to_api() == obj
