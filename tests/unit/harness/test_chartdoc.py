"""The chart README's values table is generated from values.schema.json and values.yaml
(issue 17): it is in step, it names every key with its default, and the schema and
values.yaml agree on which keys exist."""

from __future__ import annotations

import json
from typing import Any

from metaroce_harness import chartdoc


def test_the_values_table_is_in_step() -> None:
    text = chartdoc.README.read_text()
    assert chartdoc.with_table(text) == text, (
        "charts/metaroce/README.md is out of date: "
        "run .venv/bin/python -m metaroce_harness.chartdoc"
    )


def test_every_key_is_documented_with_type_default_and_meaning() -> None:
    schema, values = chartdoc.load()
    rows = list(chartdoc.rows(schema, values))
    text = chartdoc.README.read_text()
    assert len(rows) > 60
    for key, kind, default, doc in rows:
        assert f"| `{key}` | {kind} | {default} |" in text, key
        assert doc, f"{key} has no description in values.schema.json"
    assert '| `agent.kubeletRootDir` | string | `"/var/lib/kubelet"` |' in text


def test_values_yaml_and_the_schema_name_the_same_keys() -> None:
    schema, values = chartdoc.load()
    documented = {key for key, *_ in chartdoc.rows(schema, values)}
    free_form = {
        k
        for k, kind, *_ in chartdoc.rows(schema, values)
        if kind.startswith("map") or kind == "object"
    }
    set_in_values = set(chartdoc.value_keys(values))
    # keys inside free-form maps (resources.requests.cpu) are data, not chart keys
    unknown = {k for k in set_in_values - documented
               if not any(k.startswith(f + ".") for f in free_form)}  # fmt: skip
    assert not unknown, f"values.yaml sets keys the schema lacks: {sorted(unknown)}"
    leaves = {k for k, _kind, default, _ in chartdoc.rows(schema, values) if "[]" not in k}
    nested = {k.rsplit(".", 1)[0] for k in leaves if "." in k}
    missing = sorted(k for k in leaves - nested if k not in set_in_values)
    assert not missing, f"values.yaml gives no default for {missing}"


def test_types_and_defaults_render_as_written(tmp_path: Any) -> None:
    chart = tmp_path
    (chart / "values.schema.json").write_text(json.dumps({"properties": {
        "a": {"type": "object", "description": "A", "properties": {
            "b": {"type": "integer", "description": "B | pipe"},
            "c": {"type": "string", "enum": ["x", "y"], "description": "C <x>"}}},
        "d": {"type": "array", "items": {"type": "object", "properties": {
            "e": {"type": "string", "description": "E"}}}, "description": "D"},
    }}))  # fmt: skip
    (chart / "values.yaml").write_text("a: {b: 3, c: x}\nd: []\n")
    assert chartdoc.table(chart).splitlines()[2:] == [
        "| `a` | object |  | A |",
        "| `a.b` | integer | `3` | B \\| pipe |",
        '| `a.c` | `x` \\| `y` | `"x"` | C &lt;x&gt; |',
        "| `d` | list of object | `[]` | D |",
        "| `d[].e` | string |  | E |",
    ]
