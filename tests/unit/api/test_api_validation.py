"""Validation errors name the field, the value and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from metaroce_api import InvalidObject, validate_network, validate_network_update
from metaroce_api.examples import merge, minimal_network


def _issues(patch: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidObject) as err:
        validate_network(merge(minimal_network("bad"), patch))
    assert "MetaRoceNetwork 'bad' is invalid" in str(err.value)
    return {issue.path: str(issue) for issue in err.value.issues}


def test_out_of_range_names_field_value_and_limit() -> None:
    issues = _issues({"spec": {"qos": {"data": {"dscp": 64}}}})
    assert list(issues) == ["spec.qos.data.dscp"]
    assert "less than or equal to 63" in issues["spec.qos.data.dscp"]
    assert "(got 64)" in issues["spec.qos.data.dscp"]


def test_list_items_get_their_index() -> None:
    issues = _issues({"spec": {"qos": {"profile": "custom", "pfcPriorities": [3, 9]}}})
    assert "spec.qos.pfcPriorities[1]" in issues


def test_unknown_field_says_remove_or_respell() -> None:
    issues = _issues({"spec": {"transport": {"mdoe": "rocev2"}}})
    assert "unknown field: remove it or check its spelling" in issues["spec.transport.mdoe"]


def test_missing_required_field_says_add_it() -> None:
    issues = _issues({"spec": {"nics": None}})
    assert "required field is missing: add it" in issues["spec.nics"]


def test_unknown_enum_value_lists_the_choices() -> None:
    issues = _issues({"spec": {"transport": {"mode": "infiniband"}}})
    text = issues["spec.transport.mode"]
    assert "'auto', 'rocev2', 'softroce' or 'metaroce'" in text
    assert "'infiniband'" in text


def test_int_or_string_union_gives_one_issue() -> None:
    issues = _issues({"spec": {"agent": {"updateStrategy": {"maxUnavailable": [1]}}}})
    assert list(issues) == ["spec.agent.updateStrategy.maxUnavailable"]


def test_every_problem_is_reported_at_once() -> None:
    issues = _issues(
        {
            "metadata": {"name": "bad"},
            "spec": {
                "qos": {"profile": "lossy", "pfcPriorities": [3], "cnp": {"dscp": 26}},
                "transport": {"retryCount": 8},
            },
        }
    )
    assert set(issues) == {
        "spec.qos.pfcPriorities",
        "spec.qos.cnp.dscp",
        "spec.transport.retryCount",
    }


def test_network_name_must_fit_a_label_value() -> None:
    with pytest.raises(InvalidObject) as err:
        validate_network(minimal_network("a" * 64))
    assert err.value.issues[0].path == "metadata.name"


def test_duplicate_set_entries_are_refused() -> None:
    issues = _issues({"spec": {"nics": {"drivers": ["mlx5_core", "mlx5_core"]}}})
    assert "duplicate entry 'mlx5_core'" in issues["spec.nics.drivers"]


def test_duplicate_map_keys_are_refused() -> None:
    ets = [{"priority": 3, "bandwidthPercent": 50}, {"priority": 3, "bandwidthPercent": 50}]
    issues = _issues({"spec": {"qos": {"ets": ets}}})
    assert "duplicate entry {'priority': 3}" in issues["spec.qos.ets"]


def test_update_rules_run_only_on_update() -> None:
    old = merge(minimal_network("n"), {"spec": {"attachment": {"resourceName": "a.io/x"}}})
    new = merge(old, {"spec": {"attachment": {"resourceName": "a.io/y"}}})
    validate_network(new)  # fine on its own
    with pytest.raises(InvalidObject, match=r"spec\.attachment\.resourceName: .*immutable"):
        validate_network_update(old, new)
    # Adding or removing the field is a change too (the rule sits on attachment).
    with pytest.raises(InvalidObject):
        validate_network_update(minimal_network("n"), new)
    with pytest.raises(InvalidObject):
        validate_network_update(old, minimal_network("n"))
    validate_network_update(old, merge(old, {"spec": {"cleanupOnDelete": True}}))


def test_validate_network_accepts_a_model_too() -> None:
    net = validate_network(minimal_network())
    assert validate_network(net) == net
