"""CRD generation: each converter rule, the structural shape of the output, the golden files."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from metaroce_api import MetaRoceNetwork, constants, crdgen
from metaroce_api.base import ApiModel, ListType
from metaroce_api.crdgen import ConversionError, structural
from metaroce_api.examples import minimal_network

# --- converter rules -------------------------------------------------------------------


def test_refs_are_inlined_and_sibling_keys_win() -> None:
    schema = {
        "$defs": {"Inner": {"type": "object", "title": "Inner", "description": "inner doc"}},
        "type": "object",
        "properties": {"inner": {"$ref": "#/$defs/Inner", "default": {}, "description": "mine"}},
    }
    out = structural(schema)
    assert out["properties"]["inner"] == {"type": "object", "default": {}, "description": "mine"}
    assert "$defs" not in out


def test_single_allof_is_merged() -> None:
    schema = {
        "$defs": {"X": {"type": "string", "maxLength": 3}},
        "allOf": [{"$ref": "#/$defs/X"}],
        "description": "d",
    }
    assert structural(schema) == {"type": "string", "maxLength": 3, "description": "d"}


def test_optional_collapses_to_the_type_and_null_default_goes() -> None:
    schema = {"anyOf": [{"type": "integer", "maximum": 7}, {"type": "null"}], "default": None}
    assert structural(schema) == {"type": "integer", "maximum": 7}


def test_int_or_string_union() -> None:
    schema = {"anyOf": [{"type": "integer"}, {"type": "string"}], "default": 1, "maxLength": 4}
    assert structural(schema) == {"x-kubernetes-int-or-string": True, "default": 1, "maxLength": 4}


def test_int_or_string_needs_max_length_too() -> None:
    with pytest.raises(ConversionError, match="maxLength"):
        structural({"anyOf": [{"type": "integer"}, {"type": "string"}]})


def test_other_unions_are_refused() -> None:
    with pytest.raises(ConversionError, match=r"<root>: only `X \| None`"):
        structural({"anyOf": [{"type": "integer"}, {"type": "boolean"}]})


def test_titles_and_additional_properties_false_are_dropped() -> None:
    schema = {"type": "object", "title": "T", "additionalProperties": False, "properties": {}}
    assert structural(schema) == {"type": "object", "properties": {}}


def test_const_becomes_a_one_value_enum_with_max_length() -> None:
    assert structural({"type": "string", "const": "v1"}) == {
        "type": "string",
        "enum": ["v1"],
        "maxLength": 2,
    }


def test_paragraphs_survive_and_lines_unwrap() -> None:
    out = structural({"type": "boolean", "description": "one\ntwo\n\nthree\n"})
    assert out["description"] == "one two\n\nthree"


@pytest.mark.parametrize(
    ("schema", "complaint"),
    [
        ({"type": "string"}, "string without maxLength"),
        ({"type": "array", "items": {"type": "integer"}}, "list without maxItems"),
        (
            {"type": "object", "additionalProperties": {"type": "integer"}},
            "map without maxProperties",
        ),
        ({"description": "no type"}, "no type"),
        ({"type": "integer", "multipleOf": 2}, "multipleOf"),
        ({"$ref": "#/$defs/Missing"}, "unresolved"),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ],
)
def test_unbounded_or_unknown_schemas_are_refused(schema: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ConversionError, match=complaint):
        structural(schema)


def test_errors_name_the_field() -> None:
    schema = {
        "type": "object",
        "properties": {"outer": {"type": "object", "properties": {"s": {"type": "string"}}}},
    }
    with pytest.raises(ConversionError, match=r"^\.outer\.s: string without maxLength"):
        structural(schema)


def test_date_time_strings_need_no_max_length() -> None:
    assert structural({"type": "string", "format": "date-time"})["format"] == "date-time"


def test_list_map_keys_must_be_required() -> None:
    schema: dict[str, Any] = {
        "type": "array",
        "maxItems": 2,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["k"],
        "items": {"type": "object", "properties": {"k": {"type": "integer"}}},
    }
    with pytest.raises(ConversionError, match="list-type map"):
        structural(schema)
    schema["items"]["required"] = ["k"]
    assert structural(schema)["x-kubernetes-list-type"] == "map"


def test_a_model_converts_end_to_end() -> None:
    class Inner(ApiModel):
        """Inner doc."""

        level: Literal["a", "bb"] = "a"

    class Outer(ApiModel):
        """Outer doc."""

        some_list: Annotated[list[int], Field(max_length=4), ListType("set")] | None = None
        inner: Inner = Field(default_factory=Inner, json_schema_extra={"default": {}})

    out = crdgen.model_schema(Outer)
    assert out == {
        "type": "object",
        "description": "Outer doc.",
        "properties": {
            "someList": {
                "type": "array",
                "items": {"type": "integer"},
                "maxItems": 4,
                "x-kubernetes-list-type": "set",
            },
            "inner": {
                "type": "object",
                "description": "Inner doc.",
                "default": {},
                "properties": {
                    "level": {"type": "string", "enum": ["a", "bb"], "default": "a", "maxLength": 2}
                },
            },
        },
    }


# --- the generated CRDs ----------------------------------------------------------------


def _crds() -> list[dict[str, Any]]:
    return [crdgen.network_crd(), crdgen.nodestate_crd()]


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, sub in node.get("properties", {}).items():
            yield from _walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.mark.parametrize("crd", _crds(), ids=lambda c: c["spec"]["names"]["kind"])
def test_generated_schema_is_structural_and_bounded(crd: dict[str, Any]) -> None:
    for path, node in _walk(_schema(crd)):
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "$defs"} & set(node), path
        if path in ("", ".metadata", ".apiVersion", ".kind"):
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("type") == "string" and node.get("format") != "date-time":
            assert "maxLength" in node, path
        if node.get("type") == "array":
            assert "maxItems" in node and "x-kubernetes-list-type" in node, path
        if "additionalProperties" in node:
            assert "maxProperties" in node, path


@pytest.mark.parametrize("crd", _crds(), ids=lambda c: c["spec"]["names"]["kind"])
def test_crd_shape(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert spec["group"] == constants.GROUP
    assert spec["scope"] == "Cluster"
    assert spec["names"]["categories"] == [constants.CATEGORY]
    (version,) = spec["versions"]
    assert version["name"] == constants.VERSION and version["storage"] and version["served"]
    # Users write a network's spec and the operator its status (a subresource); a
    # NodeState is written whole by its agent: spec and status in one request.
    expected = {"status": {}} if spec["names"]["kind"] == constants.NETWORK_KIND else None
    assert version.get("subresources") == expected
    assert "status" in _schema(crd)["properties"]
    assert _schema(crd)["required"] == ["spec"]


def test_network_printer_columns_and_short_names() -> None:
    crd = crdgen.network_crd()
    assert crd["spec"]["names"]["shortNames"] == ["mrn"]
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    default = [c["name"] for c in columns if not c.get("priority")]
    assert default == ["Ready", "Nodes", "Transport", "Age"]


def test_nodestate_short_name() -> None:
    assert crdgen.nodestate_crd()["spec"]["names"]["shortNames"] == ["mrns"]


def test_network_name_is_limited_to_a_dns_label() -> None:
    meta = _schema(crdgen.network_crd())["properties"]["metadata"]
    assert meta["properties"]["name"]["maxLength"] == 63
    assert set(meta["properties"]) == {"name"}


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the apiserver does it (enough for these schemas)."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _apply_defaults(sub, value[key])
    if isinstance(value, list) and "items" in schema:
        value = [_apply_defaults(schema["items"], v) for v in value]
    return value


def test_crd_defaults_equal_the_python_defaults() -> None:
    obj = minimal_network("defaults")
    defaulted = _apply_defaults(_schema(crdgen.network_crd()), copy.deepcopy(obj))
    assert defaulted == MetaRoceNetwork.model_validate(obj).to_api()


# --- files -------------------------------------------------------------------------------


def test_checked_in_crds_match_the_models() -> None:
    problems = crdgen.check()
    assert not problems, "run `python -m metaroce_api.crdgen`:\n" + "\n".join(problems)


def test_default_dirs_are_in_this_repository() -> None:
    root = Path(__file__).resolve().parents[3]
    chart_copy = root / "charts" / "metaroce" / "files" / "crds"
    assert crdgen.default_dirs() == [root / "crds", chart_copy]
    # Never the chart's crds/: Helm would install those itself, whatever crds.install says.
    assert not (root / "charts" / "metaroce" / "crds").exists()


def test_write_then_check_and_stale_files_are_reported(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    assert crdgen.check(dirs)  # missing
    written = crdgen.write(dirs)
    assert sorted(p.name for p in written) == sorted(list(crdgen.generate()) * 2)
    assert crdgen.check(dirs) == []
    assert crdgen.write(dirs) == []  # nothing to do
    stale = dirs[1] / "metaroce.io_metarocenetworks.yaml"
    stale.write_text(stale.read_text().replace("maxItems: 32", "maxItems: 33", 1))
    (problem,) = crdgen.check(dirs)
    assert "-" in problem and "+" in problem and str(stale) in problem


def test_main_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 1
    assert "CRDs are stale" in capsys.readouterr().err
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 0


def test_generated_files_are_yaml_with_a_header() -> None:
    for name, text in crdgen.generate().items():
        assert text.startswith("# Generated")
        doc = yaml.safe_load(text)
        assert name == f"{constants.GROUP}_{doc['spec']['names']['plural']}.yaml"


class _Plain(BaseModel):
    value: str = Field(max_length=3)


def test_plain_pydantic_models_convert_too() -> None:
    assert crdgen.model_schema(_Plain)["properties"]["value"] == {"type": "string", "maxLength": 3}


def test_exclusive_bounds_become_openapi_v3_0_flags() -> None:
    """pydantic's gt/lt give JSON Schema's numeric exclusiveMinimum; a CRD wants
    `minimum: x` plus `exclusiveMinimum: true` (the apiserver refused the number)."""
    from metaroce_api.crdgen import structural

    out = structural({"type": "number", "exclusiveMinimum": 0.0, "exclusiveMaximum": 1})
    assert out == {
        "type": "number",
        "minimum": 0.0,
        "exclusiveMinimum": True,
        "maximum": 1,
        "exclusiveMaximum": True,
    }


def test_field_docstrings_become_descriptions_only_when_a_schema_is_made() -> None:
    """The docstring under a field is its description in the CRD (inherited ones too), read
    from the module's source when a schema is made, never while the models are imported
    (a third of the agent's start-up in the TCG guests)."""
    from metaroce_api import QosSpec
    from metaroce_api.base import attribute_docs

    assert not ApiModel.model_config.get("use_attribute_docstrings")
    docs = {k: v for k, v in attribute_docs(QosSpec).items() if k in QosSpec.model_fields}
    assert len(docs) >= 3 and all(isinstance(v, str) and v for v in docs.values())
    schema = QosSpec.model_json_schema(by_alias=True)
    for name, text in docs.items():
        info = QosSpec.model_fields[name]
        assert schema["properties"][info.alias or name]["description"] == text

    class Derived(QosSpec):  # not at module level: its docs are all inherited
        pass

    assert attribute_docs(Derived) == attribute_docs(QosSpec)
    derived = Derived.model_json_schema(by_alias=True)["properties"]
    assert all(derived[QosSpec.model_fields[n].alias or n]["description"] for n in docs)
