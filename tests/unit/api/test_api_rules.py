"""Every CEL rule has a Python twin, examples, and a place in the generated CRD."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from metaroce_api import (
    InvalidObject,
    Rule,
    all_rules,
    validate_network,
    validate_network_update,
    validate_nodestate,
    validate_nodestate_update,
)
from metaroce_api.base import Case
from metaroce_api.constants import NETWORK_KIND
from metaroce_api.crdgen import network_crd, nodestate_crd
from metaroce_api.examples import case_objects

RULES = all_rules()


def _judge(rule: Rule, case: Case) -> list[Any]:
    """Issues Python finds in the example (empty = accepted)."""
    before, obj = case_objects(rule, case, "rules")
    network = rule.kind == NETWORK_KIND
    try:
        if before is None:
            (validate_network if network else validate_nodestate)(obj)
        elif network:
            validate_network_update(before, obj)
        else:
            validate_nodestate_update(before, obj)
    except InvalidObject as err:
        return list(err.issues)
    return []


def test_there_are_rules_and_names_are_unique() -> None:
    names = [r.name for r in RULES]
    assert len(names) >= 15
    assert len(names) == len(set(names))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_has_both_examples_and_says_where(rule: Rule) -> None:
    assert rule.rejects is not None and rule.accepts is not None
    assert rule.rejects.field, "a rejection must say which field it points at"
    assert rule.message and "\n" not in rule.message
    assert ":" in rule.message, "messages say what is wrong, then the fix after a colon"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_python_rejects_the_bad_example_at_the_field(rule: Rule) -> None:
    assert rule.rejects is not None
    issues = _judge(rule, rule.rejects)
    assert [(i.path, i.rule) for i in issues] == [(rule.rejects.field, rule.name)]
    assert issues[0].message == rule.message


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_python_accepts_the_good_example(rule: Rule) -> None:
    assert rule.accepts is not None
    assert _judge(rule, rule.accepts) == []


def _validations(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(schema path, rule, node) for every x-kubernetes-validations entry."""
    if isinstance(schema, dict):
        for entry in schema.get("x-kubernetes-validations", []):
            yield path, entry, schema
        for key, sub in schema.get("properties", {}).items():
            yield from _validations(sub, f"{path}.{key}")
        if "items" in schema:
            yield from _validations(schema["items"], f"{path}[]")


def _crd_rules() -> list[tuple[str, dict[str, Any], Any]]:
    out = []
    for crd in (network_crd(), nodestate_crd()):
        out += list(_validations(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    return out


def test_every_rule_is_in_a_crd_and_nothing_else_is() -> None:
    published = {entry["rule"] for _, entry, _ in _crd_rules()}
    assert published == {r.cel for r in RULES}


def test_every_field_path_names_a_field_of_its_schema_node() -> None:
    for path, entry, node in _crd_rules():
        target = node
        for part in filter(None, entry.get("fieldPath", "").split(".")):
            assert part in target.get("properties", {}), f"{path}: {entry['fieldPath']}"
            target = target["properties"][part]


def test_rules_on_old_self_sit_outside_lists() -> None:
    """Transition rules need a node the apiserver can correlate between old and new."""
    for path, entry, _ in _crd_rules():
        if "oldSelf" in entry["rule"]:
            assert "[]" not in path, path
